"""Structured outputs' cost and guarantee, one server, one run (about 6 minutes here):

    python -m scripts.bench.structured_benchmark                  # QUANT=int4's folder
    python -m scripts.bench.structured_benchmark --model-dir build/model

- 32 concurrent greedy requests over gRPC streaming, each a prompt of the held set of JSON schemas
  (scripts/bench/structured_schemas.py) with its schema spelled out, sent without and with the schema enforced
  (guided_decoding_guide_type json_schema), alternating, --repeats times: output tokens/s (median run) and how many
  answers parse and validate with jsonschema. Enforced answers are shorter (the grammar ends them), so prefill
  weighs more in their wall time: a third run sends the unenforced requests with each one's length fixed to its
  enforced answer's, which leaves the masks as the only difference. One wave of n requests ends with a tail of a
  few rows (the longest answers), which weighs more when the answers' lengths spread, as enforced ones do; the
  sustained runs keep n requests in flight (each client sends its next at once, ROUNDS each) without and with the
  schema, as a load test at concurrency n does. The held set's prompts repeat, and a warm-up sends each once, so
  every run finds each prompt in the prefix cache whole (no prefill: python_backend/engine/prefix_cache.py); a last
  pair of one-wave runs starts each prompt with a tag of its own, which the cache has never seen (all but the chat
  template's head is prefilled);
- the masks' time per step, in this process on the same matchers the server uses, replaying the enforced answers'
  tokens: one row alone, and all rows together as the engine computes them (llguidance's thread pool);
- compile time of the held set's schemas: cold (a new compiler) and cached.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import jsonschema
import numpy as np

from python_backend.guided.compiler import GuideCompiler
from python_backend.guided.grammars import GuideSpec
from python_backend.guided.guide import apply_masks
from python_backend.model_files import MODEL_DIR_ENV, ModelSettings
from scripts.bench.structured_schemas import SCHEMAS, schema_prompt
from scripts.bench.workload import NEVER_WRITTEN, log, through_server
from scripts.launcher.triton_server import running_server
from scripts.paths import BUILD_DIR, EXPORT_DIR
from scripts.prepare.quantize import variant_dir

MAX_TOKENS = 128
MODES = ("free", "enforced", "free_same_lengths", "free_sustained", "enforced_sustained", "free_unseen",
         "enforced_unseen", "free_unseen_same_lengths")
ROUNDS = 4  # sustained: each of the n clients sends this many requests, one after another


def requests(n: int, enforce: bool, lengths: list[int] | None = None, unseen: str | None = None) -> list[dict]:
    """The held set's prompts, n of them; with ``lengths``, each request generates exactly that many tokens (no EOS:
    end_id is a token id the model never writes), to compare at the enforced answers' own lengths; with ``unseen``,
    each prompt starts with that tag and its number, so that the prefix cache holds none of it."""
    out = []
    for i in range(n):
        case = SCHEMAS[i % len(SCHEMAS)]
        prompt = schema_prompt(case) if unseen is None else f"Request {unseen}-{i}. {schema_prompt(case)}"
        request = {"text_input": prompt, "max_tokens": MAX_TOKENS, "apply_chat_template": True}
        if enforce:
            request |= {"guided_decoding_guide_type": "json_schema", "guided_decoding_guide": json.dumps(case.schema)}
        if lengths:
            request |= {"max_tokens": max(1, lengths[i]), "end_id": NEVER_WRITTEN}
        out.append(request)
    return out


def valid(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def served_runs(grpc: str, n: int, repeats: int) -> dict:
    runs = {mode: [] for mode in MODES}
    texts = {}
    # Warm-up: every schema's guide compiled and every prompt of the held set seen once, so that every run below
    # finds the prefix cache alike (a prompt seen whole needs no prefill: prefix_cache.py).
    through_server(requests(len(SCHEMAS), True), grpc, concurrent=True)
    for repeat in range(repeats):
        lengths = {}
        for mode in MODES:
            sustained = mode.endswith("_sustained")
            unseen = "_unseen" in mode
            batch = requests(n * ROUNDS if sustained else n, mode.startswith("enforced"),
                             lengths.get(unseen) if mode.endswith("_same_lengths") else None,
                             f"{repeat}{mode[0]}{len(mode)}" if unseen else None)
            results, wall = through_server(batch, grpc, concurrent=True, concurrency=n)
            if mode in ("enforced", "enforced_unseen"):  # the lengths the next *_same_lengths mode asks for
                lengths[unseen] = [r.output_tokens for r in results]
            tokens = sum(r.output_tokens for r in results)
            runs[mode].append({"tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall})
            texts[mode] = [r.text for r in results]
            log(f"{mode}: {tokens} tokens in {wall:.1f} s = {tokens / wall:.1f} tok/s")
    summary = {}
    for mode, mode_runs in runs.items():
        median = sorted(mode_runs, key=lambda r: r["tokens_per_s"])[len(mode_runs) // 2]
        cases = [SCHEMAS[i % len(SCHEMAS)] for i in range(len(texts[mode]))]
        summary[mode] = {**median, "runs": mode_runs, "answers": len(texts[mode]), "texts": texts[mode],
                         "valid": sum(valid(t, c.schema) for t, c in zip(texts[mode], cases))}
    return summary


def paired_ratio(enforced: dict, free: dict) -> float:
    """The median over repeats of each repeat's ratio: the runs of one repeat are back to back, so drift on a shared
    machine cancels better than in a ratio of medians."""
    return statistics.median(e["tokens_per_s"] / f["tokens_per_s"] for e, f in zip(enforced["runs"], free["runs"]))


def mask_times(model_dir: Path, texts: list[str], vocab_size: int, eos_ids) -> dict:
    """Median ms per step of apply_masks for one row and for all rows at once, replaying the enforced answers."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    compiler = GuideCompiler.for_model(model_dir, eos_ids, vocab_size)
    cases = [SCHEMAS[i % len(SCHEMAS)] for i in range(len(texts))]
    walks = [tokenizer.encode(t, add_special_tokens=False).ids for t in texts]

    def replay(rows: list[int]) -> list[float]:
        guides = {r: compiler.compile(GuideSpec("json_schema", json.dumps(cases[r].schema))) for r in rows}
        logits = np.zeros((len(texts), vocab_size), np.float32)
        times, step = [], 0
        while guides:
            started = time.perf_counter()
            apply_masks(logits, guides)
            times.append(time.perf_counter() - started)
            for r in list(guides):
                if step >= len(walks[r]) or not guides[r].matcher.consume_token(walks[r][step]):
                    del guides[r]  # its answer is replayed (or its re-tokenized text left the grammar's path)
            step += 1
        return times

    alone = [t for r in range(len(texts)) for t in replay([r])]
    together = replay(list(range(len(texts))))
    return {"batch_1_ms": 1000 * statistics.median(alone), "batch_all_ms": 1000 * statistics.median(together),
            "batch_all_rows": len(texts)}


def compile_times(model_dir: Path, vocab_size: int, eos_ids) -> dict:
    compiler = GuideCompiler.for_model(model_dir, eos_ids, vocab_size)
    specs = [GuideSpec("json_schema", json.dumps(case.schema)) for case in SCHEMAS]
    cold, cached = [], []
    for spec in specs:
        started = time.perf_counter()
        compiler.compile(spec)
        cold.append(time.perf_counter() - started)
    for spec in specs:
        started = time.perf_counter()
        compiler.compile(spec)
        cached.append(time.perf_counter() - started)
    return {"cold_median_ms": 1000 * statistics.median(cold), "cold_max_ms": 1000 * max(cold),
            "cached_median_ms": 1000 * statistics.median(cached), "schemas": len(specs)}


def run(model_dir: Path, n: int = 32, repeats: int = 3, log_path: Path | None = None) -> dict:
    settings = ModelSettings.load(model_dir)
    log(f"structured outputs: {n} concurrent requests, without and with the schema, {repeats} runs, on {model_dir}")
    log_path = log_path or BUILD_DIR / "benchmark-structured-server.log"
    with running_server(log_path=log_path, env={MODEL_DIR_ENV: str(model_dir)}) as ports:
        served = served_runs(f"127.0.0.1:{ports.grpc}", n, repeats)
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(model_dir / "tokenizer.json")).get_vocab_size()
    result = {"model_dir": str(model_dir), "requests": n, "max_tokens": MAX_TOKENS, **served,
              "ratio": paired_ratio(served["enforced"], served["free"]),
              "ratio_same_lengths": paired_ratio(served["enforced"], served["free_same_lengths"]),
              "ratio_sustained": paired_ratio(served["enforced_sustained"], served["free_sustained"]),
              "ratio_unseen": paired_ratio(served["enforced_unseen"], served["free_unseen"]),
              "ratio_unseen_same_lengths": paired_ratio(served["enforced_unseen"], served["free_unseen_same_lengths"]),
              "masks": mask_times(model_dir, served["enforced"]["texts"], vocab, settings.eos_token_ids),
              "compile": compile_times(model_dir, vocab, settings.eos_token_ids)}
    return result


def print_table(result: dict) -> None:
    free, enforced, masks, comp = result["free"], result["enforced"], result["masks"], result["compile"]
    print(f"\nStructured outputs: {result['requests']} concurrent requests, held-set prompts, max_tokens "
          f"{result['max_tokens']}, greedy (median of {len(free['runs'])} runs)")
    print("| | output tokens | output tok/s | answers that parse and validate |")
    print("| --- | --- | --- | --- |")
    print(f"| without the schema enforced | {free['tokens']} | {free['tokens_per_s']:.1f} | "
          f"{free['valid']}/{free['answers']} |")
    print(f"| with the schema enforced | {enforced['tokens']} | {enforced['tokens_per_s']:.1f} | "
          f"{enforced['valid']}/{enforced['answers']} |")
    same = result["free_same_lengths"]
    print(f"| without, each request as long as its enforced answer | {same['tokens']} | {same['tokens_per_s']:.1f} | |")
    print(f"| enforced / without (median of the runs' ratios) | | x{result['ratio']:.2f} | |")
    print(f"| enforced / without at the same lengths (the same) | | x{result['ratio_same_lengths']:.2f} | |")
    free_s, enforced_s = result["free_sustained"], result["enforced_sustained"]
    print(f"| sustained, {result['requests']} in flight, without the schema enforced | {free_s['tokens']} | "
          f"{free_s['tokens_per_s']:.1f} | {free_s['valid']}/{free_s['answers']} |")
    print(f"| sustained, {result['requests']} in flight, with the schema enforced | {enforced_s['tokens']} | "
          f"{enforced_s['tokens_per_s']:.1f} | {enforced_s['valid']}/{enforced_s['answers']} |")
    print(f"| sustained: enforced / without (the same) | | x{result['ratio_sustained']:.2f} | |")
    free_u, enforced_u = result["free_unseen"], result["enforced_unseen"]
    print(f"| prompts not seen before, without the schema enforced | {free_u['tokens']} | "
          f"{free_u['tokens_per_s']:.1f} | {free_u['valid']}/{free_u['answers']} |")
    print(f"| prompts not seen before, with the schema enforced | {enforced_u['tokens']} | "
          f"{enforced_u['tokens_per_s']:.1f} | {enforced_u['valid']}/{enforced_u['answers']} |")
    print(f"| prompts not seen before: enforced / without (the same) | | x{result['ratio_unseen']:.2f} | |")
    same_u = result["free_unseen_same_lengths"]
    print(f"| prompts not seen before, without, each as long as its enforced answer | {same_u['tokens']} | "
          f"{same_u['tokens_per_s']:.1f} | |")
    print(f"| prompts not seen before: enforced / without at the same lengths (the same) | | "
          f"x{result['ratio_unseen_same_lengths']:.2f} | |")
    print(f"\nmask time per step (median): one row {masks['batch_1_ms']:.3f} ms; {masks['batch_all_rows']} rows at "
          f"once {masks['batch_all_ms']:.3f} ms")
    print(f"compile time of the {comp['schemas']} schemas: cold median {comp['cold_median_ms']:.2f} ms "
          f"(max {comp['cold_max_ms']:.2f} ms), cached median {comp['cached_median_ms']:.3f} ms")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, default=variant_dir(EXPORT_DIR, "int4"))
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", type=Path, default=BUILD_DIR / "benchmark-structured.json")
    args = parser.parse_args(argv)
    result = run(args.model_dir, args.requests, args.repeats)
    args.output.write_text(json.dumps(result, indent=2))
    print_table(result)
    print(f"\n(written to {args.output})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
