"""Speculative greedy decoding for one stream, measured before the engine has it: is the exact default's one stream
(fp32: ~38 tok/s served, as the export's fp32, both reading 540 MB of weights a token) able to reach issue 34's 1.6x
over the export without leaving fp32's answers?

    python -m scripts.bench.speculative_probe                       # fp32 checked by the fast variant's drafts
    python -m scripts.bench.speculative_probe --draft-tokens 4 8 --prompts 42
    python -m scripts.bench.speculative_probe --engine-parity        # the served path against fp32 PyTorch

One row, in this process, on the fp32 and draft variants' fused graphs with their slot caches (python_backend/
runtime/onnx_slot_decoder.py) and on the export's own graph. Each load-test prompt (chat template applied) is
decoded greedily for --tokens tokens:
- the export's graph, plain: the export itself with its padded cache (the engine's KVBatch), one token a call: the
  baseline issue 34 names;
- plain: fp32, one token a call, as the engine decodes a lone row;
- speculative: the draft variant (`fast`, 2.5x fp32's one-stream speed, its greedy text fp32's for 30 tokens on
  average: its parity report) proposes K tokens one call each; fp32 checks all of them in one call of K+1 tokens
  (its logits at every new position: the graph's `logits_all_positions`), keeps the drafts up to the first one it
  would not have chosen and adds its own token there. Both caches then drop what was not kept: a row's length is
  its mask's sum, so the next call writes over it.
The answers must be the plain ones token for token ("identical"), and the speed is output tokens over wall time.

--engine-parity: the engine itself as it serves (python_backend/engine/speculative.py, 6 drafts a round), each of the
42 parity prompts alone, greedy, 64 tokens: its answers against fp32 PyTorch's (the variants' parity report's
reference, scripts/prepare/variant_parity.py), which the report's own batched run never drafts for.

All sessions run on one onnxruntime thread pool shared by the process (`set_global_thread_pool_sizes`): two pools
of their own, alternating, each spinning while the other works, gave the speculative loop no gain at all (x0.96,
2026-12-05); with spinning switched off in both, plain decoding lost 17%.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import numpy as np

from python_backend.engine.speculative import DEFAULT_DRAFT_TOKENS
from scripts.paths import default_model_dir


def slot_cache(decoder, max_len: int) -> list[np.ndarray]:
    shape = decoder.cache_shape
    return [np.zeros((1, shape.num_kv_heads, max_len, shape.head_dim), np.dtype(shape.dtype))
            for _ in shape.cache_names()]


def forward(decoder, cache, ids: list[int], total: int, all_positions: bool = False) -> np.ndarray:
    return decoder.forward_in_place(np.array([ids], np.int64), np.ones((1, total), np.int64), cache,
                                    all_positions=all_positions)[0]


def plain(target, prompt: list[int], tokens: int, max_len: int) -> list[int]:
    cache = slot_cache(target, max_len)
    out = [int(forward(target, cache, prompt, len(prompt))[-1].argmax())]
    while len(out) < tokens:
        out.append(int(forward(target, cache, [out[-1]], len(prompt) + len(out))[-1].argmax()))
    return out


def plain_export(export, prompt: list[int], tokens: int) -> list[int]:
    """The export's own graph and its padded cache (the GPU runtimes' path; fp32's served path before the fused
    graph), as the engine's padded batch decodes a lone row: issue 34's baseline."""
    from python_backend.engine.kv_batch import KVBatch

    batch, logits, _ = KVBatch.prefill(export, [prompt])
    out = [int(logits[0].argmax())]
    while len(out) < tokens:
        out.append(int(batch.step(export, np.array([out[-1]]))[0].argmax()))
    return out


def speculative(target, draft, prompt: list[int], tokens: int, k: int, max_len: int) -> tuple[list[int], int]:
    """The greedy answer and how many rounds (fp32 calls after the prompt) it took."""
    target_cache, draft_cache = slot_cache(target, max_len), slot_cache(draft, max_len)
    out = [int(forward(target, target_cache, prompt, len(prompt))[-1].argmax())]
    forward(draft, draft_cache, prompt, len(prompt))
    draft_valid, rounds = len(prompt), 0  # the draft cache's tokens that are the sequence's
    while len(out) < tokens:
        sequence = prompt + out
        proposed = [int(forward(draft, draft_cache, sequence[draft_valid:], len(sequence))[-1].argmax())]
        for i in range(k - 1):
            proposed.append(int(forward(draft, draft_cache, [proposed[-1]], len(sequence) + i + 1)[-1].argmax()))
        chosen = forward(target, target_cache, [sequence[-1], *proposed], len(sequence) + k,
                         all_positions=True).argmax(-1)
        kept = next((i for i in range(k) if chosen[i] != proposed[i]), k)
        out += proposed[:kept] + [int(chosen[kept])]
        draft_valid = len(sequence) + min(kept, k - 1)
        rounds += 1
    return out[:tokens], rounds


def engine_parity(target, draft, export: Path, draft_tokens: int) -> tuple[int, int, float, float]:
    """The engine with a drafter, each parity prompt alone: (identical to fp32 PyTorch, prompts, tok/s, mean
    tokens a round)."""
    import functools
    import json

    from python_backend.engine.core import EngineCore
    from python_backend.engine.sampling import SamplingParams
    from python_backend.engine.scheduler import SchedulerConfig
    from python_backend.engine.sequence import Sequence
    from python_backend.engine.speculative import Drafter
    from python_backend.model_files import SETTINGS_FILE
    from python_backend.serving.tokenization import PromptTokenizer
    from scripts.prepare.variant_parity import (GREEDY_TOKENS, agreement, load_reference_model, load_test_prompts,
                                                reference_greedy)

    tokenizer = PromptTokenizer(export)
    prompts = [tokenizer.encode(p, apply_chat_template=False) for p in load_test_prompts()]
    hf_dir = json.loads((export / SETTINGS_FILE).read_text())["hf_dir"]
    reference = reference_greedy(export, functools.cache(lambda: load_reference_model(hf_dir)), prompts)
    max_len = max(map(len, prompts)) + GREEDY_TOKENS + 1
    config = SchedulerConfig(max_batch_size=1, kv_budget_tokens=4 * max_len, kv_layout="slots",
                             max_context_length=max_len)
    drafter, answers, rounds = Drafter(draft, draft_tokens, max_len), [], 0
    started = time.perf_counter()
    for prompt in prompts:
        core = EngineCore(target, config, drafter=drafter)
        seq = Sequence(prompt_ids=prompt, params=SamplingParams(max_tokens=GREEDY_TOKENS))  # EOS does not stop it
        core.add(seq)
        while core.step().progressed:
            pass
        answers.append(seq.output_ids)
        rounds += core.speculation.rounds
    seconds = time.perf_counter() - started
    same = agreement(answers, reference)["identical"]
    return same, len(prompts), len(prompts) * GREEDY_TOKENS / seconds, len(prompts) * (GREEDY_TOKENS - 1) / rounds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, default=None, help="the fp32 export (default: make model's)")
    parser.add_argument("--draft", default="fast", help="the draft variant (default: fast)")
    parser.add_argument("--draft-tokens", type=int, nargs="+", default=None,
                        help="K: drafts a round (default 4 6 8; with --engine-parity the engine's 6)")
    parser.add_argument("--prompts", type=int, default=12, help="how many load-test prompts (of 42)")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--engine-parity", action="store_true", help="the engine with drafts against fp32 PyTorch")
    args = parser.parse_args(argv)
    if args.draft_tokens is None and not args.engine_parity:
        args.draft_tokens = [4, 6, 8]

    import onnxruntime as ort
    from onnxruntime.capi import _pybind_state

    from python_backend.model_files import ONNX_FILE
    from python_backend.runtime.onnx_decoder import OnnxDecoder
    from python_backend.runtime.onnx_slot_decoder import OnnxSlotDecoder
    from python_backend.serving.tokenization import PromptTokenizer
    from scripts.prepare.quantize import variant_dir
    from scripts.prepare.variant_parity import load_test_prompts

    _pybind_state.set_global_thread_pool_sizes(args.threads, 1)  # before the first session

    def decoder(folder, kind=OnnxSlotDecoder):
        options = ort.SessionOptions()  # its thread counts are the pool's
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.use_per_session_threads = False
        session = ort.InferenceSession(str(folder / ONNX_FILE), options, providers=["CPUExecutionProvider"])
        return kind(None, session=session)

    export = args.model_dir or default_model_dir()
    target, draft = decoder(variant_dir(export, "fp32")), decoder(variant_dir(export, args.draft))
    if args.engine_parity:
        k = args.draft_tokens[0] if args.draft_tokens else DEFAULT_DRAFT_TOKENS
        same, count, rate, per_round = engine_parity(target, draft, export, k)
        print(f"the engine, fp32 checking {k} {args.draft} drafts, each prompt alone: {same}/{count} greedy answers "
              f"identical to fp32 PyTorch over 64 tokens; {rate:.1f} tok/s, {per_round:.2f} tokens a round")
        return 0
    export_graph = decoder(export, OnnxDecoder)
    tokenizer = PromptTokenizer(export)
    prompts = [tokenizer.encode(p, apply_chat_template=True) for p in load_test_prompts()[:args.prompts]]
    max_len = max(map(len, prompts)) + args.tokens + max(args.draft_tokens) + 2
    plain(target, prompts[0], 4, max_len)  # warm the sessions
    plain_export(export_graph, prompts[0], 4)
    speculative(target, draft, prompts[0], 4, 2, max_len)

    started = time.perf_counter()
    from_export = [plain_export(export_graph, p, args.tokens) for p in prompts]
    export_s = time.perf_counter() - started
    started = time.perf_counter()
    expected = [plain(target, p, args.tokens, max_len) for p in prompts]
    plain_s = time.perf_counter() - started
    total = len(prompts) * args.tokens
    print(f"{len(prompts)} load-test prompts x {args.tokens} tokens, one at a time, {args.threads} threads")
    print("| decoding | tok/s | x plain | x the export | identical to plain | tokens per fp32 call |\n"
          "| --- | --- | --- | --- | --- | --- |")
    same = sum(a == b for a, b in zip(from_export, expected))
    print(f"| the export's graph (padded cache), plain | {total / export_s:.1f} | {plain_s / export_s:.2f} | 1.00 "
          f"| {same}/{len(prompts)} | 1.00 |")
    print(f"| fp32 (fused graph, slot cache), plain | {total / plain_s:.1f} | 1.00 | {export_s / plain_s:.2f} | - "
          "| 1.00 |")
    for k in args.draft_tokens:
        started = time.perf_counter()
        runs = [speculative(target, draft, p, args.tokens, k, max_len) for p in prompts]
        seconds = time.perf_counter() - started
        same = sum(answer == want for (answer, _), want in zip(runs, expected))
        per_call = statistics.mean(args.tokens / rounds for _, rounds in runs)
        print(f"| fp32 checking {k} {args.draft} drafts a round | {total / seconds:.1f} | {plain_s / seconds:.2f} | "
              f"{export_s / seconds:.2f} | {same}/{len(prompts)} | {per_call:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
