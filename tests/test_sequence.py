from python_backend.engine.sampling import SamplingParams, TokenLogprob
from python_backend.engine.sequence import Sequence


def make(**kwargs):
    return Sequence(prompt_ids=[1, 2], params=SamplingParams(**{"max_tokens": 5, "end_ids": (0,), **kwargs}))


def test_eos_ends_without_being_output():
    seq = make()
    for token in (7, 8, 0):
        seq.append(token)
    assert seq.output_ids == [7, 8] and seq.finish_reason == "eos"


def test_max_tokens_ends_with_length():
    seq = make(max_tokens=2)
    seq.append(7)
    assert not seq.finished
    seq.append(8)
    assert seq.output_ids == [7, 8] and seq.finish_reason == "length"


def test_stop_sequence_ends_and_is_removed():
    seq = make(stop_token_sequences=((8, 9),))
    for token in (7, 8, 9):
        seq.append(token)
    assert seq.output_ids == [7] and seq.finish_reason == "stop"


def test_partial_stop_sequence_does_not_stop():
    seq = make(stop_token_sequences=((8, 9),))
    for token in (8, 7, 9):
        seq.append(token)
    assert seq.output_ids == [8, 7, 9] and not seq.finished


def test_log_probabilities_stay_aligned_with_the_ids_handed_out():
    seq = make(logprobs=True, stop_token_sequences=((8, 9),))
    for token in (7, 8):
        seq.append(token, TokenLogprob(-float(token)))
    assert seq.take_emittable() == ([7], [TokenLogprob(-7.0)])  # 8 is held back: it may begin the stop sequence
    seq.append(9, TokenLogprob(-9.0))  # the stop sequence: 8 and 9 and their log-probabilities go
    assert seq.logprobs == [TokenLogprob(-7.0)] and seq.take_emittable() == ([], [])
    seq = make()
    seq.append(7, None)
    assert seq.take_emittable() == ([7], None)  # not asked for: none are kept
