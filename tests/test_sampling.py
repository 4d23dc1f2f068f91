import numpy as np
import pytest

from python_backend.engine.sampling import SamplingParams, TokenChooser, token_logprob, validate_sampling_values
from python_backend.errors import InvalidRequestError

LOGITS = np.array([1.0, 3.0, 2.5, -1.0, 0.5], np.float32)


@pytest.mark.parametrize(
    "values, named",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"max_tokens": 4, "temperature": -0.1}, "temperature"),
        ({"max_tokens": 4, "temperature": float("nan")}, "temperature"),
        ({"max_tokens": 4, "top_p": 0.0}, "top_p"),
        ({"max_tokens": 4, "top_p": 1.01}, "top_p"),
        ({"max_tokens": 4, "top_k": -1}, "top_k"),
        ({"max_tokens": 4, "repetition_penalty": 0.0}, "repetition_penalty"),
        ({"max_tokens": 4, "seed": -1}, "seed"),
    ],
)
def test_bad_values_are_named(values, named):
    with pytest.raises(InvalidRequestError, match=named):
        validate_sampling_values(**values)


def test_good_values_pass():
    validate_sampling_values(max_tokens=1, temperature=0.7, top_k=50, top_p=1.0, repetition_penalty=1.1, seed=0)


def test_greedy_is_argmax():
    assert TokenChooser(SamplingParams(max_tokens=1)).choose(LOGITS, []) == 1


def test_top_k_one_and_tiny_top_p_are_argmax_even_when_sampling():
    for params in (SamplingParams(max_tokens=1, temperature=5.0, top_k=1, seed=1),
                   SamplingParams(max_tokens=1, temperature=5.0, top_p=1e-6, seed=1)):
        chooser = TokenChooser(params)
        assert {chooser.choose(LOGITS, []) for _ in range(50)} == {1}


def _top_p_by_sorting_everything(probs: np.ndarray, top_p: float) -> np.ndarray:
    """The definition: the smallest prefix of the whole vocabulary, most likely first (ties by token id), whose mass
    reaches top_p, renormalized."""
    order = np.argsort(-probs, kind="stable")
    keep = order[np.cumsum(probs[order]) - probs[order] < top_p]
    filtered = np.zeros_like(probs)
    filtered[keep] = probs[keep]
    return filtered / filtered.sum()


def _normalized(weights: np.ndarray) -> np.ndarray:
    return weights / weights.sum()


def test_top_p_keeps_exactly_the_prefix_that_sorting_the_whole_vocabulary_keeps():
    """top_p sorts only the tokens that can be kept: the same kept tokens, bit for bit the same probabilities (so a
    seed draws the same tokens), on peaked, flat, tied and top_k-truncated rows, and where a kept token is barely more
    likely than the ones left out (a head just short of top_p, then a long tail of equal tokens)."""
    from python_backend.engine.sampling import _top_p_filter

    rng = np.random.default_rng(0)
    vocab = 49152
    peaked = rng.normal(0, 3, vocab)
    peaked[17] += 15
    truncated = np.where(np.arange(vocab) % 7 == 0, rng.normal(0, 1, vocab), -np.inf)
    rows = {
        "peaked": _normalized(np.exp(peaked - peaked.max())),
        "heavy-tailed": _normalized(np.exp(rng.standard_t(3, vocab) * 2.5)),
        "flat": _normalized(np.exp(rng.normal(0, 0.01, vocab))),
        "tied": _normalized(np.exp(np.round(rng.normal(0, 1, vocab), 1))),
        "top_k-truncated": _normalized(np.exp(truncated - truncated.max())),
        # top_p 0.9: the head holds 0.899, and about 490 tail tokens of 2.05e-6 each are kept after it
        "head and long tail": np.r_[0.899, np.full(vocab - 1, 0.101 / (vocab - 1))],
    }
    for name, probs in rows.items():
        for top_p in (0.5, 0.9, 0.95, 0.999999, 1 - 1e-12):
            expected = _top_p_by_sorting_everything(probs, top_p)
            assert np.array_equal(_top_p_filter(probs, top_p), expected), (name, top_p)
    kept = np.count_nonzero(_top_p_filter(rows["head and long tail"], 0.9))
    assert 400 < kept < 600, kept


def test_top_k_limits_the_candidates():
    chooser = TokenChooser(SamplingParams(max_tokens=1, temperature=100.0, top_k=2, seed=0))
    assert {chooser.choose(LOGITS, []) for _ in range(200)} == {1, 2}


def test_same_seed_same_choices_and_different_seed_differs():
    def draws(seed):
        chooser = TokenChooser(SamplingParams(max_tokens=1, temperature=2.0, seed=seed))
        return [chooser.choose(LOGITS, []) for _ in range(40)]

    assert draws(7) == draws(7)
    assert draws(7) != draws(8)


def test_repetition_penalty_moves_greedy_off_a_seen_token():
    chooser = TokenChooser(SamplingParams(max_tokens=1, repetition_penalty=2.0))
    assert chooser.choose(LOGITS, generated=[1]) == 2  # 3.0 / 2 = 1.5 < 2.5


def test_repetition_penalty_counts_the_prompts_tokens_too():
    params = SamplingParams(max_tokens=1, repetition_penalty=2.0)
    assert TokenChooser(params, prompt=[1]).choose(LOGITS, generated=[]) == 2
    assert TokenChooser(params, prompt=[3]).choose(LOGITS, generated=[]) == 1


@pytest.mark.parametrize("temperature, penalty", [(1.0, 1e-38), (1e-38, 1.0), (1.4e-45, 1e-38), (0.0, 1e-38)])
def test_extreme_but_valid_settings_still_choose_a_token(temperature, penalty):
    logits = np.array([38.5, 30.0, -20.0, 0.0], np.float32)  # fp32, as the model's: 38.5 / 1e-38 overflows fp32
    params = SamplingParams(max_tokens=4, temperature=temperature, repetition_penalty=penalty, seed=0)
    chosen = TokenChooser(params).choose(logits, generated=[0, 1])
    assert 0 <= chosen < 4


def test_non_finite_logits_are_an_error_not_a_nan_sample():
    with pytest.raises(FloatingPointError, match="not finite"):
        TokenChooser(SamplingParams(max_tokens=1, temperature=1.0, seed=0)).choose(
            np.array([1.0, np.nan], np.float32), [])


def log_softmax(logits):
    x = logits.astype(np.float64)
    return x - x.max() - np.log(np.exp(x - x.max()).sum())


def test_token_logprob_is_the_log_softmax_of_the_raw_logits_with_the_top_tokens_in_order():
    expected = log_softmax(LOGITS)
    lp = token_logprob(LOGITS, 2, top=3)
    assert lp.logprob == pytest.approx(expected[2], abs=1e-12)
    assert lp.top_ids == (1, 2, 0) and np.allclose(lp.top_logprobs, expected[[1, 2, 0]])
    assert token_logprob(LOGITS, 4).top_ids == ()
    many = np.random.default_rng(0).normal(size=1000).astype(np.float32)
    lp = token_logprob(many, 0, top=20)
    assert lp.top_ids == tuple(np.argsort(-log_softmax(many), kind="stable")[:20])
    assert np.all(np.diff(lp.top_logprobs) <= 0)


def test_presence_and_frequency_penalties_count_generated_tokens_only():
    # token 1 leads by 0.5; generated twice it loses presence 0.2 + 2 x frequency 0.2 = 0.6, and token 2 wins
    chooser = TokenChooser(SamplingParams(max_tokens=4, presence_penalty=0.2, frequency_penalty=0.2), prompt=[2, 2])
    assert chooser.choose(LOGITS, generated=[1]) == 1  # 0.4 off: still ahead
    assert chooser.choose(LOGITS, generated=[1, 1]) == 2
    negative = TokenChooser(SamplingParams(max_tokens=4, presence_penalty=-1.0, frequency_penalty=-1.0))
    assert negative.choose(LOGITS, generated=[0, 0]) == 0  # a negative penalty favours what was said: 1 + 1 + 2 > 3


def test_logit_bias_adds_to_the_logits_even_when_greedy():
    assert TokenChooser(SamplingParams(max_tokens=4, logit_bias=((3, 4.5),))).choose(LOGITS, []) == 3
    assert TokenChooser(SamplingParams(max_tokens=4, logit_bias=((1, -100.0),))).choose(LOGITS, []) == 2


@pytest.mark.parametrize("name", ["presence_penalty", "frequency_penalty"])
@pytest.mark.parametrize("value", [2.01, -2.5, float("nan")])
def test_penalties_outside_openai_range_are_named(name, value):
    with pytest.raises(InvalidRequestError, match=name):
        validate_sampling_values(max_tokens=4, **{name: value})
