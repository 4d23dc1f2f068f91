"""Prefix caching on the fused graph of the engine tests' tiny model (QUANT=fp32, exact; tests/tiny_engine_model.py):
greedy tokens identical with reuse on and off for shared prefixes of several lengths, a whole prompt cached, a batch
and a cancelled neighbour; salts kept apart; the least recently used prefix evicted under a small budget and
recomputed to the same tokens; the cache's token and byte counts, kept as entries come and go, always the sums over
the entries it holds."""

from dataclasses import replace

import numpy as np
import pytest

from python_backend.engine.core import EngineCore
from python_backend.engine.sampling import SamplingParams
from python_backend.engine.scheduler import SchedulerConfig
from python_backend.engine.sequence import Sequence
from python_backend.model_files import ONNX_FILE
from python_backend.runtime.factory import cpu_decoder
from tests.helpers import CountingDecoder, variant_folder

SYSTEM = ("You are a careful assistant for a shipping company. Answer in one short sentence, name the port if one "
          "is asked for, never invent tracking numbers, and say plainly when you do not know. ")
QUESTIONS = ["Where is Rotterdam?", "What is a bill of lading?", "Name a port in Japan.", "What does TEU mean?",
             "Is Hamburg a port?", "How long is a container?"]
CONFIG = SchedulerConfig(max_batch_size=8, kv_layout="slots", max_context_length=512, kv_budget_tokens=65536)


@pytest.fixture(scope="module")
def decoder(tiny_dir):
    return cpu_decoder(variant_folder(tiny_dir, "fp32") / ONNX_FILE)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return [tokenizer.encode(SYSTEM + q, apply_chat_template=True) for q in QUESTIONS]


def sequences(prompts, salt="", max_tokens=12):
    return [Sequence(prompt_ids=list(p), params=SamplingParams(max_tokens=max_tokens, end_ids=()), cache_salt=salt)
            for p in prompts]


def run(core, seqs, on_step=None):
    for seq in seqs:
        core.add(seq)
    while core.step().progressed:
        if on_step:
            on_step(core)
    return [s.output_ids for s in seqs]


@pytest.fixture(scope="module")
def without_reuse(decoder, prompts):
    """Each prompt's tokens with prefix caching off, computed in one batch (a batch gives each row its answer alone:
    tests/test_kv_slots.py)."""
    return run(EngineCore(decoder, CONFIG), sequences(prompts))


def reuse(decoder, **changes):
    return EngineCore(decoder, replace(CONFIG, enable_kv_cache_reuse=True, **changes))


def page_bytes(decoder, block_tokens=16) -> int:
    """The bytes of one cached block: its keys and values in every layer."""
    shape = decoder.cache_shape
    return shape.num_kv_heads * block_tokens * shape.head_dim * np.dtype(shape.dtype).itemsize * len(
        shape.cache_names())


def assert_counts_are_the_entries_sums(core, decoder):
    """The prefix cache's running counts (kept as entries are added and dropped) equal the tokens and bytes summed
    over the entries it holds now: a block of the pool each, a whole prompt's logits each."""
    entries = list(core.prefix._blocks.values())
    held_tokens = sum(entry.cost for entry in entries)
    held_bytes = sum(page_bytes(decoder) * (entry.index is not None)
                     + (entry.logits.nbytes if entry.logits is not None else 0) for entry in entries)
    assert (core.prefix.cached_tokens, core.prefix.cached_bytes()) == (held_tokens, held_bytes)


def test_shared_prefixes_of_every_kind_give_the_same_tokens(decoder, prompts, without_reuse, tokenizer):
    core = reuse(decoder)
    assert run(core, sequences(prompts[:1])) == without_reuse[:1]  # fills the cache
    assert core.prefix.hit_tokens == 0 and core.prefix.cached_tokens > 0
    # the others one at a time: each shares the system prompt's blocks
    for prompt, expected in zip(prompts[1:], without_reuse[1:]):
        assert run(core, sequences([prompt])) == [expected]
    assert core.prefix.hit_tokens >= 5 * (len(tokenizer.encode(SYSTEM, apply_chat_template=True)) // 16 - 1) * 16
    # a prompt seen whole: all of it comes from the cache, and its first token from its cached logits
    hits = core.prefix.hit_tokens
    assert run(core, sequences(prompts[:1])) == without_reuse[:1]
    assert core.prefix.hit_tokens - hits == len(prompts[0])
    # prefixes ending at every offset inside a block: prompts cut short share 0..15 tokens of their last block (their
    # answers without reuse computed together: a batch gives each row its answer alone, tests/test_kv_slots.py)
    cuts = range(1, 17, 3)
    shorts = [prompts[0][: len(prompts[0]) - cut] for cut in cuts]
    alone = run(EngineCore(decoder, CONFIG), sequences(shorts))
    for cut, short, expected in zip(cuts, shorts, alone):
        assert run(core, sequences([short])) == [expected], cut


class GraphBeforeQueryLengths(CountingDecoder):
    """A fused graph built before query_seqlens (format 8): it takes several new tokens after a past for one row."""

    def forward_in_place(self, input_ids, attention_mask, cache, **options):
        if input_ids.shape[0] > 1 and 1 < input_ids.shape[1] < attention_mask.shape[1]:
            raise RuntimeError("batch_size must be 1 when sequence_length > 1 and past context is given")
        return super().forward_in_place(input_ids, attention_mask, cache, **options)


@pytest.mark.parametrize("graph", [CountingDecoder, GraphBeforeQueryLengths])
def test_prompts_behind_a_cached_prefix_are_prefilled_in_one_step_to_the_same_tokens(decoder, prompts, without_reuse,
                                                                                       graph):
    """Five prompts behind the cached system prompt: the step's prefill budget, short of two whole prompts, counts
    only the tokens to compute, so all five rests are prefilled in the same step, before any decode step, in one
    call (right-padded, each after its own cached prefix: query_seqlens; a graph without it: one call each), and
    each answer is the one computed without reuse."""
    counting = graph(decoder)
    core = reuse(counting, max_prefill_tokens=2 * max(len(p) for p in prompts) - 1)
    run(core, sequences(prompts[:1]))
    counting.calls.clear()
    counts = (core.prefix.queried_tokens, core.prefix.hit_tokens)
    found = [core.prefix.found_tokens(p) for p in prompts[1:]]  # what the budget leaves out: a look, not a lookup
    assert (core.prefix.queried_tokens, core.prefix.hit_tokens) == counts and min(found) > 0
    assert core.prefix.found_tokens(prompts[1], scores_top=1) == 0  # a prompt to score needs blocks with scores
    assert run(core, sequences(prompts[1:])) == without_reuse[1:]
    rests = [len(p) - f for p, f in zip(prompts[1:], found)]
    calls = [(len(rests), max(rests))] if graph is CountingDecoder else [(1, rest) for rest in rests]
    assert sorted(counting.calls[:len(calls)]) == sorted(calls) and min(rests) < max(rests)  # before any decode
    assert all(shape[1] == 1 for shape in counting.calls[len(calls):])
    assert core.prefix.hit_tokens - counts[1] == sum(found)  # found as the look said


def test_a_prompt_seen_whole_is_answered_without_a_prefill(decoder, prompts, without_reuse):
    counting = CountingDecoder(decoder)
    core = reuse(counting)
    assert run(core, sequences(prompts[:1])) == without_reuse[:1]
    full, tail = divmod(len(prompts[0]), 16)
    one_prompt = (full * 16 + (16 if tail else 0) + core.prefix.logits_tokens,  # its blocks and its whole entry
                  (full + bool(tail)) * page_bytes(decoder) + decoder.vocab_size * 4)
    assert (core.prefix.cached_tokens, core.prefix.cached_bytes()) == one_prompt and one_prompt[0] > full * 16
    counting.calls.clear()
    assert run(core, sequences(prompts[:1])) == without_reuse[:1]
    # the first token from the cached logits, then one decode step for each of the other 11
    assert counting.calls == [(1, 1)] * 11
    counting.calls.clear()
    assert run(core, sequences(prompts[:1], salt="tenant-b")) == without_reuse[:1]
    assert counting.calls[0] == (1, len(prompts[0])), "under another salt the prompt is computed again"
    assert (core.prefix.cached_tokens, core.prefix.cached_bytes()) == (2 * one_prompt[0], 2 * one_prompt[1])
    # room for one prompt's entries: the least recently used, the first salt's, are evicted, and the counts follow
    evicted = core.prefix.evicted_blocks
    core.prefix.trim(one_prompt[0])
    assert core.prefix.evicted_blocks - evicted == full + 1  # its full blocks and its whole entry
    assert (core.prefix.cached_tokens, core.prefix.cached_bytes()) == one_prompt
    assert_counts_are_the_entries_sums(core, decoder)


class FailingRest(CountingDecoder):
    """Fails the rest of a prompt (new tokens after a past) that holds this token."""

    def __init__(self, inner, token: int):
        super().__init__(inner)
        self.token = token

    def forward_in_place(self, input_ids, attention_mask, cache, **options):
        if 1 < input_ids.shape[1] < attention_mask.shape[1] and self.token in input_ids:
            raise RuntimeError("injected: this rest fails")
        return super().forward_in_place(input_ids, attention_mask, cache, **options)



def test_copies_of_a_prompt_whose_rest_fails_fail_with_it_and_a_neighbour_is_unchanged(decoder, prompts,
                                                                                        without_reuse):
    bad, good = prompts[1], prompts[2]
    token = next(t for t in bad if t not in good)  # in its question, computed after the cached system prompt
    core = reuse(FailingRest(decoder, token))
    run(core, sequences(prompts[:1]))  # caches the shared system prompt
    seqs = sequences([bad, good, bad])
    outputs = run(core, seqs)
    assert [s.finish_reason for s in seqs] == ["error", "length", "error"]
    assert outputs[1] == without_reuse[2]


class UnwritablePool:
    """A layer's pool of the prefix cache whose pages cannot be written (the system out of memory)."""

    def __init__(self, inner):
        self.inner = inner

    def __getitem__(self, key):
        return self.inner[key]

    def __setitem__(self, key, value):
        raise MemoryError("no page for the block")


def test_a_prefix_the_cache_fails_to_store_costs_only_the_reuse(decoder, prompts, without_reuse, capfd):
    core = reuse(decoder)
    free = len(core.prefix._free)
    core.prefix._pool = [UnwritablePool(pool) for pool in core.prefix._pool]
    assert run(core, sequences(prompts)) == without_reuse
    said = "[engine] prefix cache: a prompt was not stored: MemoryError: no page for the block"
    assert said in capfd.readouterr().err
    assert (len(core.prefix._free), core.prefix.cached_tokens) == (free, 0), "a page taken for a failed copy was lost"


def test_an_error_after_rows_joined_fails_the_step_and_never_computes_a_row_twice(decoder, prompts, without_reuse):
    """The chunk's per-sequence retry is for errors before a row joins the cache: computed again, a row that joined
    would run twice (the same sequence in two rows, each step adding two tokens to it)."""
    core = reuse(decoder)
    choose = core._choose_first
    calls = []

    def failing_once(joined, logits):
        calls.append(len(joined))
        if len(calls) == 1:
            raise RuntimeError("after the rows joined")
        return choose(joined, logits)

    core._choose_first = failing_once
    seqs = sequences(prompts[:3])
    for seq in seqs:
        core.add(seq)
    out = core.step()
    assert isinstance(out.error, RuntimeError) and calls == [3]
    assert [s.finish_reason for s in seqs] == ["error"] * 3 and core.running == [] and core.cache.size == 0
    assert run(core, sequences(prompts[:3])) == without_reuse[:3]  # the next requests are served as ever


def test_a_batch_sharing_a_prefix_and_a_cancelled_neighbour(decoder, prompts, without_reuse):
    core = reuse(decoder)
    run(core, sequences(prompts[:1]))
    seqs = sequences(prompts)

    def cancel_the_second(c):
        if len(seqs[1].output_ids) == 3:
            c.cancel(seqs[1].key)

    outputs = run(core, seqs, on_step=cancel_the_second)
    assert seqs[1].finish_reason == "cancelled"
    assert [o for i, o in enumerate(outputs) if i != 1] == [o for i, o in enumerate(without_reuse) if i != 1]
    assert core.prefix.hit_tokens > 0
    # all of them again at once: each found whole, each with its own keys, values and logits
    hits = core.prefix.hit_tokens
    assert run(core, sequences(prompts)) == without_reuse
    assert core.prefix.hit_tokens - hits == sum(len(p) for p in prompts)


def test_salts_keep_prefixes_apart(decoder, prompts, without_reuse):
    core = reuse(decoder)
    run(core, sequences(prompts[:1], salt="tenant-a"))
    assert run(core, sequences(prompts[1:2], salt="tenant-b")) == without_reuse[1:2]
    assert core.prefix.hit_tokens == 0, "another salt finds nothing"
    assert run(core, sequences(prompts[1:2], salt="tenant-a")) == without_reuse[1:2]
    assert core.prefix.hit_tokens > 0, "the same salt shares"


def test_the_least_recently_used_prefix_is_evicted_under_a_small_budget(decoder, prompts, tokenizer):
    other = tokenizer.encode("Completely different instructions about baking bread at home, with flour, water, salt "
                             "and patience, for a beginner. " + QUESTIONS[0], apply_chat_template=True)
    need = max(len(prompts[0]), len(other)) + 12
    core = reuse(decoder, kv_budget_tokens=need + 48)  # beside a running request, room for three blocks at most
    first = run(core, sequences(prompts[:1]))
    assert (core.prefix.cached_tokens, core.prefix.cached_bytes()) == (48, 3 * page_bytes(decoder))
    # its own blocks need the room: the least recently used of the first's go (the counts checked after each step)
    run(core, sequences([other]), on_step=lambda c: assert_counts_are_the_entries_sums(c, decoder))
    assert core.prefix.evicted_blocks > 0 and core.prefix.cached_tokens <= 48 + 16
    assert 0 < core.prefix.cached_bytes() <= 4 * page_bytes(decoder)
    hits = core.prefix.hit_tokens
    assert run(core, sequences(prompts[:1])) == first, "recomputed after eviction, the same tokens"
    assert core.prefix.hit_tokens - hits < 48, "what was evicted was computed again, not found"


def test_the_switch_off_computes_everything_and_the_padded_cache_refuses_it(decoder, prompts, tiny_dir):
    core = EngineCore(decoder, CONFIG)
    run(core, sequences(prompts[:2]))
    assert core.prefix is None
    with pytest.raises(ValueError, match="enable_kv_cache_reuse needs a fused graph"):
        EngineCore(cpu_decoder(tiny_dir / ONNX_FILE), SchedulerConfig(enable_kv_cache_reuse=True))


def test_log_probabilities_after_a_cached_prefix_are_a_full_prefills_bit_for_bit(decoder, prompts):
    def logprobs(core, prompt):
        seq = Sequence(prompt_ids=list(prompt), params=SamplingParams(max_tokens=4, end_ids=(), logprobs=True,
                                                                      top_logprobs=5))
        run(core, [seq])
        return [(lp.logprob, lp.top_ids, lp.top_logprobs) for lp in seq.logprobs]

    core = reuse(decoder)
    one_past_a_block = prompts[0][: 16 * (len(prompts[0]) // 16 - 1) + 1]  # whole blocks but one token
    # the second shares a prefix with the first; each again is wholly cached
    for prompt in (prompts[0], prompts[1], one_past_a_block):
        assert logprobs(core, prompt) == logprobs(EngineCore(decoder, CONFIG), prompt)
        assert logprobs(core, prompt) == logprobs(EngineCore(decoder, CONFIG), prompt)
    assert core.prefix.hit_tokens > 0


def test_a_text_prefix_that_ends_inside_a_merge_reuses_only_the_common_tokens(decoder, tokenizer):
    # The first text is a prefix of the second, but its trailing space is a token of its own, which the second
    # merges into " ports": the cache is keyed by token ids, so only the blocks of the common ids are reused.
    first = tokenizer.encode(SYSTEM + "Tell me about ", apply_chat_template=False)
    second = tokenizer.encode(SYSTEM + "Tell me about ports", apply_chat_template=False)
    common = next((i for i, (a, b) in enumerate(zip(first, second)) if a != b), len(first))
    assert common < len(first), "the texts' shared prefix is not a shared token prefix"
    core = reuse(decoder)
    run(core, sequences([first]))
    hits = core.prefix.hit_tokens
    assert run(core, sequences([second])) == run(EngineCore(decoder, CONFIG), sequences([second]))
    assert 0 < core.prefix.hit_tokens - hits <= common // 16 * 16

