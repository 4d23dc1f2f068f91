from python_backend.frontend import CancellationWatch, text_deltas


def decode(ids):
    return "".join(chr(ord("a") + i) for i in ids)


def test_stream_deltas_and_unary_text_agree():
    chunks = [([0], False), ([1, 2], False), ([], False), ([3], True)]
    deltas = list(text_deltas(chunks, decode, stream=True))
    assert [d.text for d in deltas] == ["a", "bc", "d"] and deltas[-1].finished
    assert sum(d.token_count for d in deltas) == 4
    [whole] = text_deltas(chunks, decode, stream=False)
    assert whole.text == "abcd" and whole.token_count == 4 and whole.finished


def test_a_cancelled_client_cancels_once_and_the_stream_is_drained():
    consumed, cancels, state = [], [], {"gone": False}

    def chunks():
        for i in range(5):
            consumed.append(i)
            if i == 1:
                state["gone"] = True
            yield [i], i == 4

    deltas = list(text_deltas(chunks(), decode, True, lambda: state["gone"], lambda: cancels.append(1)))
    assert [d.text for d in deltas] == ["a"] and cancels == [1] and consumed == [0, 1, 2, 3, 4]


def test_the_watch_cancels_waiting_requests_once():
    sent, gone = [], {"a": False, "b": False}
    watch = CancellationWatch(sent.append)
    watch.add("a", lambda: gone["a"])
    watch.add("b", lambda: gone["b"])
    watch.poll()
    assert sent == []
    gone["a"] = True
    watch.poll()
    watch.poll()
    watch.cancel("a")
    assert sent == ["a"]
    watch.remove("b")
    gone["b"] = True
    watch.poll()
    assert sent == ["a"]


def test_the_watch_stops_asking_once_a_request_streams_but_it_can_still_be_cancelled():
    sent, asked = [], []
    watch = CancellationWatch(sent.append)
    watch.add("a", lambda: asked.append("a") or True)
    watch.started("a")
    watch.poll()
    assert asked == [] and sent == []
    watch.cancel("a")
    watch.cancel("a")
    assert sent == ["a"]
