import pytest

from python_backend.serving.frontend import CancellationWatch, LlmChunk, StopStrings, text_deltas

ANSWER = "The capital of France is Paris."


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


def one_token_per_chunk(ids):
    return [([i], n == len(ids) - 1) for n, i in enumerate(ids)]


def stream_and_unary(chunks, decode, stop):
    deltas = list(text_deltas(chunks, decode, True, stop=stop))
    [unary] = text_deltas(chunks, decode, False, stop=stop)
    return deltas, unary


@pytest.mark.parametrize("stop, expected, tokens", [
    ("France is", "The capital of ", 5),  # two tokens, " France" and " is", in two chunks
    ("aris", "The capital of France is P", 6),  # begins inside the token " Paris"
    ("Berlin", ANSWER, 7),  # never generated
    (".\n", ANSWER, 7),  # the final "." is held back until the llm finishes, then released
])
def test_stop_strings_are_matched_on_the_generated_text(tokenizer, stop, expected, tokens):
    ids = tokenizer.encode_plain(ANSWER)
    assert [tokenizer.decode([i]) for i in ids] == ["The", " capital", " of", " France", " is", " Paris", "."]
    deltas, unary = stream_and_unary(one_token_per_chunk(ids), tokenizer.decode, [stop])
    assert unary.text == expected and unary.token_count == tokens and unary.finished
    assert "".join(d.text for d in deltas) == expected and sum(d.token_count for d in deltas) == tokens
    assert [d.finished for d in deltas] == [False] * (len(deltas) - 1) + [True]
    assert not any(stop in d.text for d in deltas)


def test_text_that_may_begin_a_stop_string_is_held_back_until_it_is_decided(tokenizer):
    ids = tokenizer.encode_plain(ANSWER)
    deltas = [d.text for d in text_deltas(one_token_per_chunk(ids), tokenizer.decode, True, stop=["France!"])]
    assert deltas == ["The", " capital", " of", " ", "France is", " Paris", "."]


def test_the_earliest_of_several_stop_strings_ends_the_answer_across_chunks(tokenizer):
    ids = tokenizer.encode_plain(ANSWER)
    chunks = [(ids[:3], False), (ids[3:5], False), (ids[5:], True)]
    deltas, unary = stream_and_unary(chunks, tokenizer.decode, ["Paris", "ital of Fr", ""])
    # read token by token (the chunks hold several, as speculative decoding's do): the answer's tokens end at
    # " France", which completed the match, not with its chunk's " is"
    assert unary.text == "The cap" and unary.token_count == 4
    assert [d.text for d in deltas] == ["The", " cap", ""] and [d.token_count for d in deltas] == [1, 1, 2]
    [whole] = text_deltas([(ids, True)], tokenizer.decode, False, stop=["Paris", "of"])
    assert whole.text == "The capital "


def test_a_stop_string_cancels_the_llm_once_and_its_stream_is_drained():
    consumed, cancels, state = [], [], {"gone": False}

    def chunks():
        for i in range(6):
            consumed.append(i)
            state["gone"] = i >= 3  # the client leaves after the answer: no second cancel
            yield [i], i == 5

    deltas = list(text_deltas(chunks(), decode, True, lambda: state["gone"], lambda: cancels.append(1), stop=["bc"]))
    assert [(d.text, d.token_count, d.finished) for d in deltas] == [("a", 1, False), ("", 2, True)]
    assert cancels == [1] and consumed == [0, 1, 2, 3, 4, 5]


def test_a_chunk_of_several_tokens_ends_at_the_token_that_completed_the_stop_string():
    cancels = []
    chunk = LlmChunk([0, 1, 2, 3], False, None, [-0.5, -1.0, -1.5, -2.0], [[-0.5]] * 4, [[0], [1], [2], [3]])
    [answer] = text_deltas([chunk, ([4], True)], decode, False, cancel=lambda: cancels.append(1), stop=["bc"])
    assert answer.text == "a" and answer.ids == [0, 1, 2] and answer.logprobs == [-0.5, -1.0, -1.5]
    assert answer.top_ids == [[0], [1], [2]] and cancels == [1]  # the llm had not finished: it is cancelled


def test_a_stop_string_in_the_last_chunk_needs_no_cancel():
    cancels = []
    [answer] = text_deltas([([0], False), ([1, 2], True)], decode, False, cancel=lambda: cancels.append(1),
                           stop=["c"])
    assert answer.text == "ab" and answer.token_count == 3 and cancels == []


def test_held_back_text_is_released_when_the_llm_finishes_without_a_match():
    stops = StopStrings(["xyz", "yq"])
    assert stops.push("abxy") == ("ab", False)  # "xy" may begin "xyz"
    assert stops.push("z") == ("", True)
    stops = StopStrings(["xyz", "yq"])
    assert stops.push("abxy") == ("ab", False)
    assert stops.push("w") == ("xyw", False)
    assert stops.push("x") == ("", False) and stops.flush() == "x"


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
