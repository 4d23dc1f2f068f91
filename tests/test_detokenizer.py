from python_backend.serving.detokenizer import IncrementalDetokenizer

TEXTS = [
    "Hello world, this is a test.",
    " leading space and  double space",
    "长城是中国古代的军事防御工程。",
    "Emoji: 🙂🚀 and 👩‍👩‍👧 family",
    "def f(x):\n    return x * 2\n",
]


def test_deltas_add_up_to_the_full_decode_token_by_token(tokenizer):
    for text in TEXTS:
        ids = tokenizer.encode_plain(text)
        detok = IncrementalDetokenizer(tokenizer.decode)
        deltas = [detok.push([i]) for i in ids] + [detok.flush()]
        assert "".join(deltas) == tokenizer.decode(ids) == text
        assert all("\ufffd" not in d for d in deltas), deltas


def test_unfinished_character_is_held_back(tokenizer):
    ids = tokenizer.encode_plain("🙂")
    assert len(ids) > 1, "the emoji spans several byte-level tokens"
    detok = IncrementalDetokenizer(tokenizer.decode)
    assert [detok.push([i]) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.push(ids[-1:]) == "🙂"


def test_flush_returns_a_truncated_character(tokenizer):
    ids = tokenizer.encode_plain("ab🙂")
    detok = IncrementalDetokenizer(tokenizer.decode)
    text = "".join(detok.push([i]) for i in ids[:-1]) + detok.flush()
    assert text == tokenizer.decode(ids[:-1])
