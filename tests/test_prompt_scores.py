"""Scoring prompts (each prompt token's log-probability given the tokens before it: what evaluation harnesses ask) in
the engine: the default model's fp32 export against transformers' own log-softmax; an exact fused graph (the engine
tests' tiny model's fp32) bit for bit alone, in a batch of 32, with prefix caching on and off; the shared context of
several choices scored once (the prefix cache's hit counter); max_tokens 0 scores and generates nothing."""

from dataclasses import replace

import numpy as np
import pytest

from python_backend.engine.core import EngineCore
from python_backend.engine.prefix_cache import PrefixCache
from python_backend.engine.sampling import (SamplingParams, TokenLogprob, prompt_token_logprobs, token_logprob,
                                            validate_sampling_values)
from python_backend.engine.scheduler import SchedulerConfig
from python_backend.engine.sequence import Sequence
from python_backend.errors import InvalidRequestError
from python_backend.model_files import ONNX_FILE
from python_backend.runtime.decoder import CacheShape
from python_backend.runtime.factory import cpu_decoder
from tests.helpers import variant_folder

CONTEXT = ("Question: Which of these is a port city on the North Sea? Think about the geography of Europe and the "
           "rivers that meet the sea there before you answer.\nAnswer:")
CHOICES = [" Rotterdam", " Madrid", " Vienna", " Prague"]
SLOTS = SchedulerConfig(max_batch_size=32, kv_layout="slots", max_context_length=256, kv_budget_tokens=65536)
PADDED = SchedulerConfig(max_batch_size=32, max_context_length=256, kv_budget_tokens=65536)


def scoring(prompt, max_tokens=0, top=0, salt=""):
    return Sequence(prompt_ids=list(prompt), cache_salt=salt, params=SamplingParams(
        max_tokens=max_tokens, end_ids=(), prompt_logprobs=True, logprobs=bool(top), top_logprobs=top))


def run(core, seqs):
    for seq in seqs:
        core.add(seq)
    while core.step().progressed:
        pass
    return seqs


def values(seq) -> list[float]:
    """A scored prompt's log-probabilities, the first token's (none) left out."""
    assert seq.prompt_logprobs[0] is None and len(seq.prompt_logprobs) == len(seq.prompt_ids)
    return [s.logprob for s in seq.prompt_logprobs[1:]]


@pytest.fixture(scope="module")
def choice_prompts(tokenizer):
    return [tokenizer.encode(CONTEXT + choice, apply_chat_template=False) for choice in CHOICES]


@pytest.fixture(scope="module")
def exact(tiny_dir):
    """An exact fused graph (its slot cache, prefix caching): the engine tests' tiny model's fp32 variant
    (tests/tiny_engine_model.py: what these tests check is the engine's, whatever the weights)."""
    return cpu_decoder(variant_folder(tiny_dir, "fp32") / ONNX_FILE)


def test_scores_are_the_log_softmax_of_the_position_before_each_token():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(70, 300)).astype(np.float32) * 4  # more positions than one chunk of the computation
    tokens = rng.integers(0, 300, size=70)
    scores = prompt_token_logprobs(logits, tokens, top=3)
    for i in (0, 33, 64, 69):
        assert scores[i] == token_logprob(logits[i], int(tokens[i]), 3)
    assert [s.logprob for s in prompt_token_logprobs(logits, tokens)] == [s.logprob for s in scores]


def test_the_fp32_exports_scores_match_transformers(decoder, hf_model, choice_prompts):
    """Every prompt token of every choice, scored in one padded batch, within 1e-4 of transformers' log-softmax."""
    import torch

    seqs = run(EngineCore(decoder, PADDED), [scoring(p) for p in choice_prompts])
    for seq, prompt in zip(seqs, choice_prompts):
        with torch.no_grad():
            logits = hf_model(torch.tensor([prompt])).logits[0].double()
        expected = torch.log_softmax(logits, -1)[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
        np.testing.assert_allclose(values(seq), expected.numpy(), atol=1e-4)
        assert seq.output_ids == [] and seq.finish_reason == "length"


def test_top_scores_hold_the_most_likely_tokens_most_likely_first(decoder, choice_prompts):
    seq = run(EngineCore(decoder, PADDED), [scoring(choice_prompts[0], top=3)])[0]
    for score, token in zip(seq.prompt_logprobs[1:], seq.prompt_ids[1:]):
        assert len(score.top_ids) == 3 and list(score.top_logprobs) == sorted(score.top_logprobs, reverse=True)
        assert score.logprob <= score.top_logprobs[0]
        assert (token == score.top_ids[0]) == (score.logprob == score.top_logprobs[0])


def test_a_scored_prompt_also_generates_with_the_same_first_token(exact, choice_prompts):
    plain = Sequence(prompt_ids=list(choice_prompts[0]), params=SamplingParams(max_tokens=4, end_ids=()))
    scored = scoring(choice_prompts[0], max_tokens=4)
    run(EngineCore(exact, SLOTS), [plain, scored])
    assert scored.output_ids == plain.output_ids and len(scored.output_ids) == 4


def test_scores_on_the_exact_graph_are_the_same_bits_alone_in_a_batch_and_with_reuse(exact, choice_prompts, kv_prompts):
    alone = [values(run(EngineCore(exact, SLOTS), [scoring(p)])[0]) for p in choice_prompts]
    others = [p for p in kv_prompts * 8][:32 - len(choice_prompts)]
    batch = run(EngineCore(exact, SLOTS), [scoring(p) for p in choice_prompts + others])
    assert [values(s) for s in batch[:len(choice_prompts)]] == alone
    core = EngineCore(exact, replace(SLOTS, enable_kv_cache_reuse=True))
    for round_ in range(2):  # the first fills the cache, the second is served from it (and the first choice whole)
        before = core.prefix.hit_tokens
        reused = [values(run(core, [scoring(p)])[0]) for p in choice_prompts]
        assert reused == alone, f"round {round_}"
    assert core.prefix.hit_tokens - before >= len(choice_prompts) * 32


def test_a_prefix_cached_by_a_request_that_did_not_score_is_computed_again_to_score(exact, choice_prompts):
    alone = values(run(EngineCore(exact, SLOTS), [scoring(choice_prompts[1])])[0])
    core = EngineCore(exact, replace(SLOTS, enable_kv_cache_reuse=True))
    run(core, [Sequence(prompt_ids=list(choice_prompts[0]), params=SamplingParams(max_tokens=2, end_ids=()))])
    assert core.prefix.match(choice_prompts[1]).blocks  # the shared context is cached, without scores
    assert values(run(core, [scoring(choice_prompts[1])])[0]) == alone


def test_the_shared_context_of_the_choices_is_scored_once(exact, choice_prompts):
    """After the first choice, each other choice computes only what follows the cached blocks of the context."""
    core = EngineCore(exact, replace(SLOTS, enable_kv_cache_reuse=True))
    computed = []
    for prompt in choice_prompts:
        core.add(scoring(prompt))
        while (out := core.step()).progressed:
            computed += [e.computed for e in out.events if type(e).__name__ == "Prefilled"]
    block = core.prefix.block_tokens
    shared = min(len(p) for p in choice_prompts) // block * block
    assert shared >= 32
    for prompt, cost in zip(choice_prompts[1:], computed[1:]):
        assert cost <= len(prompt) - shared + 1 + block, (cost, len(prompt))


def test_a_block_cached_without_scores_is_not_used_to_score():
    shape = CacheShape(num_layers=1, num_kv_heads=1, head_dim=4, dtype=np.dtype(np.float32))
    cache = PrefixCache(shape, capacity_tokens=256, block_tokens=16)
    prompt = list(range(40))
    row = [np.zeros((1, 1, 64, 4), np.float32), np.zeros((1, 1, 64, 4), np.float32)]
    cache.store(prompt, "", row, 256)
    assert len(cache.match(prompt).blocks) == 2 and not cache.match(prompt, scores_top=0)
    scores = [None] + [TokenLogprob(-1.0 * i, (i,), (-0.5,)) for i in range(1, 40)]
    cache.store(prompt, "", row, 256, scores=scores, scores_top=1)
    hit = cache.match(prompt, scores_top=1)
    assert len(hit.blocks) == 2 and hit.scores() == scores[:32]
    assert not cache.match(prompt, scores_top=2)  # fewer top tokens kept than asked for


def test_max_tokens_0_is_allowed_only_to_score_the_prompt():
    with pytest.raises(InvalidRequestError, match="max_tokens must be > 0"):
        validate_sampling_values(max_tokens=0)
    validate_sampling_values(max_tokens=0, prompt_logprobs=True)
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        validate_sampling_values(max_tokens=-1, prompt_logprobs=True)
