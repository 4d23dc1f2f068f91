"""Sampling parameters (validated once, at the edge) and the per-sequence token chooser."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from python_backend.errors import InvalidRequestError


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 0.0  # 0 means greedy
    top_k: int = 0  # 0 means no top-k cut
    top_p: float = 1.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    stop_token_sequences: tuple[tuple[int, ...], ...] = ()
    end_ids: tuple[int, ...] = field(default=())
    # OpenAI's: subtracted from a token's logit, presence once if the token was generated, frequency per time.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    logprobs: bool = False  # hand out each chosen token's log-probability
    top_logprobs: int = 0  # and the most likely tokens' at each position
    # Score the prompt: each prompt token's log-probability given the tokens before it (and the top_logprobs most
    # likely tokens' there). max_tokens may then be 0: the prompt is scored and nothing generated.
    prompt_logprobs: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def plain_logits(self) -> bool:
        """Nothing changes the model's logits before the choice."""
        return (self.repetition_penalty == 1.0 and not self.presence_penalty and not self.frequency_penalty
                and not self.logit_bias)


@dataclass(frozen=True)
class TokenLogprob:
    """The log-softmax of the model's own logits at one position (before penalties, temperature, top-k/p):
    the chosen token's value, and the ``top`` most likely tokens', most likely first."""
    logprob: float
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


SCORE_CHUNK_POSITIONS = 64  # positions log-softmaxed at once (float64: 64 x vocab x 8 bytes)


def prompt_token_logprobs(logits: np.ndarray, tokens: list[int] | np.ndarray, top: int = 0) -> list[TokenLogprob]:
    """Each token's log-probability under the logits of the position before it: ``logits[i]`` [vocab] scores
    ``tokens[i]``, with the ``top`` most likely tokens there (as token_logprob does for one position)."""
    tokens = np.asarray(tokens, np.int64)
    scores: list[TokenLogprob] = []
    for start in range(0, len(tokens), SCORE_CHUNK_POSITIONS):
        chunk = logits[start:start + SCORE_CHUNK_POSITIONS].astype(np.float64)
        chunk -= chunk.max(axis=-1, keepdims=True)
        chunk -= np.log(np.exp(chunk).sum(axis=-1, keepdims=True))
        picked = chunk[np.arange(len(chunk)), tokens[start:start + len(chunk)]]
        if not top:
            scores += [TokenLogprob(float(v)) for v in picked]
            continue
        k = min(top, chunk.shape[-1])
        best = np.argpartition(-chunk, k - 1, axis=-1)[:, :k]
        values = np.take_along_axis(chunk, best, axis=-1)
        order = np.argsort(-values, axis=-1, kind="stable")
        best, values = np.take_along_axis(best, order, axis=-1), np.take_along_axis(values, order, axis=-1)
        scores += [TokenLogprob(float(v), tuple(int(i) for i in ids), tuple(float(x) for x in vals))
                   for v, ids, vals in zip(picked, best, values)]
    return scores


def token_logprob(logits: np.ndarray, token: int, top: int = 0) -> TokenLogprob:
    """One position's: ``logits`` [vocab] scores ``token``."""
    return prompt_token_logprobs(logits[None], [token], top)[0]


def validate_sampling_values(
    *,
    max_tokens: int,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    repetition_penalty: float = 1.0,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    seed: int | None = None,
    prompt_logprobs: bool = False,
) -> None:
    """Raise InvalidRequestError naming the first bad value."""
    if max_tokens < 0 or (max_tokens == 0 and not prompt_logprobs):
        raise InvalidRequestError(f"max_tokens must be > 0 (or 0 with return_prompt_log_probs: score the prompt "
                                  f"only), got {max_tokens}")
    if not np.isfinite(temperature) or temperature < 0:
        raise InvalidRequestError(f"temperature must be >= 0, got {temperature}")
    if top_k < 0:
        raise InvalidRequestError(f"top_k must be >= 0, got {top_k}")
    if not np.isfinite(top_p) or not 0.0 < top_p <= 1.0:
        raise InvalidRequestError(f"top_p must be in (0, 1], got {top_p}")
    if not np.isfinite(repetition_penalty) or repetition_penalty <= 0:
        raise InvalidRequestError(f"repetition_penalty must be > 0, got {repetition_penalty}")
    for name, value in (("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty)):
        if not np.isfinite(value) or not -2.0 <= value <= 2.0:
            raise InvalidRequestError(f"{name} must be in [-2, 2], got {value}")
    if seed is not None and seed < 0:
        raise InvalidRequestError(f"seed must be >= 0, got {seed}")


class TokenChooser:
    """Chooses the next token of one sequence from its logits row.

    ``repetition_penalty`` applies to every token the sequence has seen, prompt included, as transformers' and
    vLLM's do (CTRL's definition: a seen token's positive logit is divided by it, a negative one multiplied).
    ``presence_penalty`` and ``frequency_penalty`` apply to the generated tokens only, as OpenAI defines them;
    then ``logit_bias`` is added."""

    def __init__(self, params: SamplingParams, prompt: list[int] = ()):
        self.params = params
        self._rng = np.random.default_rng(params.seed)
        self._prompt_ids = np.unique(np.asarray(prompt, np.int64)) if params.repetition_penalty != 1.0 else None

    def choose(self, logits: np.ndarray, generated: list[int]) -> int:
        p = self.params
        if p.greedy and p.plain_logits:  # the hot path: no arithmetic that could overflow
            token = int(np.argmax(logits))
            if not np.isfinite(logits[token]):
                raise FloatingPointError("the logits are not finite")
            return token
        # float64: a tiny repetition_penalty or temperature divides fp32 logits past fp32's range (inf, then NaN).
        logits = logits.astype(np.float64)
        if p.repetition_penalty != 1.0:
            seen = np.union1d(self._prompt_ids, np.asarray(generated, np.int64))
            logits = _apply_repetition_penalty(logits, seen, p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and generated:
            ids, counts = np.unique(np.asarray(generated, np.int64), return_counts=True)
            logits[ids] -= p.presence_penalty + p.frequency_penalty * counts
        for token, bias in p.logit_bias:
            logits[token] += bias
        # -inf rules a token out (a guide's mask does so); NaN, +inf, or nothing finite left is a fault.
        if np.isnan(logits).any() or np.isposinf(logits).any() or not np.isfinite(logits).any():
            raise FloatingPointError("the logits are not finite")
        if p.greedy:
            return int(np.argmax(logits))
        scaled = logits / p.temperature
        if p.top_k:
            k = min(p.top_k, scaled.shape[-1])
            kth = np.partition(scaled, -k)[-k]
            scaled = np.where(scaled < kth, -np.inf, scaled)
        probs = np.exp(scaled - scaled.max())
        probs /= probs.sum()
        if not np.isfinite(probs).all():
            raise FloatingPointError(f"sampling at temperature {p.temperature} gave non-finite probabilities")
        if p.top_p < 1.0:
            probs = _top_p_filter(probs, p.top_p)
        return int(self._rng.choice(probs.shape[-1], p=probs))


def _apply_repetition_penalty(logits: np.ndarray, ids: np.ndarray, penalty: float) -> np.ndarray:
    if not ids.size:
        return logits
    seen = logits[ids]
    logits[ids] = np.where(seen > 0, seen / penalty, seen * penalty)
    return logits


# Below this margin (top_p within 2e-9 of 1) rounding in the sums could matter: the whole vocabulary is sorted.
_TOP_P_MARGIN = 1e-9


def _top_p_filter(probs: np.ndarray, top_p: float) -> np.ndarray:
    # Only the tokens at least this likely can be kept: those below it hold less than half of 1 - top_p in all, so the
    # tokens ahead of them already reach top_p. Sorting these alone gives the same prefix, in the same order and with
    # the same sums, as sorting the whole vocabulary, which took most of a sampled token's time (1 to 2,624 of
    # SmolLM2's 49,152 tokens on 24 rows of its logits at temperature 0.8 and top_p 0.95, 6 or fewer on most).
    margin = (1.0 - top_p) / 2
    candidates = np.flatnonzero(probs >= margin / probs.size) if margin >= _TOP_P_MARGIN else np.arange(probs.size)
    order = candidates[np.argsort(-probs[candidates], kind="stable")]
    cumulative = np.cumsum(probs[order])
    # Keep the smallest prefix whose mass reaches top_p (always at least one token).
    keep = cumulative - probs[order] < top_p
    filtered = np.zeros_like(probs)
    filtered[order[keep]] = probs[order[keep]]
    return filtered / filtered.sum()
