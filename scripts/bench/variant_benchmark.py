"""The quantized variants side by side through the real server, one run, the same workload for each.

    python -m scripts.bench.variant_benchmark --variants export,fp32,int4,fast,fp16  (make benchmark runs it too)
    python -m scripts.bench.variant_benchmark --variants export,fp32,int4,fast --peers (make benchmark-peers)

For each variant a tritonserver serves its folder (scripts/prepare/quantize.py; fp32 is the export itself), continuous
strategy. Columns: output tok/s of the N requests sent one at a time (single stream); output tok/s, TTFT p50/p95 of
all N sent at once (median of --repeats runs); resident memory of the llm model's process after the runs; KV-cache
bytes per token; model file size; greedy agreement with fp32 PyTorch from the folder's parity report (42 prompts x
64 tokens), and on this workload (the single-stream answers' text against fp32 PyTorch greedy's, as the peers').

Each variant is served as configured: speculative decoding on (model_repository/llm/config.pbtxt's
speculative_draft: fp32 and fp16 check the fast variant's drafts while a request decodes alone); --no-speculation
serves plain decoding.

--peers: llama.cpp's server and onnxruntime-genai's generator on the same workload (scripts/bench/peers.py; built
once by `python -m scripts.bench.peers --build`, about 8 minutes), in a second table beside the variants.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from python_backend.model_files import MODEL_DIR_ENV, ONNX_FILE, PARITY_REPORT_FILE
from python_backend.runtime.onnx_decoder import file_cache_shape
from scripts.bench import peers
from scripts.bench.workload import median_run, server_row, through_server, workload
from scripts.launcher.model_control import SERVED_MODELS, reload_llm
from scripts.launcher.triton_server import running_server
from scripts.paths import BUILD_DIR, EXPORT_DIR
from scripts.prepare.quantize import EXPORT_VARIANT, QUANT_CHOICES, variant_dir


@dataclass
class VariantRow:
    variant: str
    single_stream_tokens_per_s: float
    concurrent_tokens_per_s: float
    ttft_p50: float
    ttft_p95: float
    llm_rss_mb: float
    kv_bytes_per_token: int
    model_mb: float
    greedy_identical: str
    mean_tokens_to_first_difference: float
    workload_identical: int  # single-stream answers equal to fp32 PyTorch greedy's on the benchmark's workload
    requests: int


def log(message: str) -> None:
    print(f"[variants] {message}", file=sys.stderr, flush=True)


def llm_process_rss_mb() -> float:
    """Resident memory of the llm model's stub process (a grandchild of this process)."""
    import psutil

    for child in psutil.Process().children(recursive=True):
        try:
            if any(a.endswith("model.py") and Path(a).parent.parent.name == "llm" for a in child.cmdline()):
                return child.memory_info().rss / 2 ** 20
        except psutil.Error:
            continue
    raise RuntimeError("no llm model process found")


def kv_bytes_per_token(model_dir: Path) -> int:
    return file_cache_shape(model_dir / ONNX_FILE).bytes_per_token()


def measure(variant: str, model_dir: Path, requests: list[dict], repeats: int,
            reference: list[str] | None = None, speculation: bool = True) -> VariantRow:
    """reference: fp32 PyTorch greedy's answers as text (default: the served model's, reference_texts());
    speculation False: the llm model reloaded with speculative_draft "" (plain decoding) before the runs."""
    report = json.loads((model_dir / PARITY_REPORT_FILE).read_text())
    greedy = report.get("greedy_agreement")
    log_path = BUILD_DIR / f"benchmark-variant-{variant}.log"
    with running_server(log_path=log_path, env={MODEL_DIR_ENV: str(model_dir.resolve())},
                        explicit_models=None if speculation else SERVED_MODELS) as ports:
        grpc = f"127.0.0.1:{ports.grpc}"
        if not speculation:
            reload_llm(f"127.0.0.1:{ports.http}", speculative_draft="")
        through_server(requests[:2], grpc, concurrent=True)  # warm-up
        log(f"{variant}: {len(requests)} requests one at a time")
        alone, _ = through_server(requests, grpc, concurrent=False)
        single = sum(r.output_tokens for r in alone) / sum(r.latency_s for r in alone)
        log(f"{variant}: {len(requests)} concurrent requests, {repeats} runs")
        runs = [server_row(variant, *through_server(requests, grpc, concurrent=True), None) for _ in range(repeats)]
        log("  output tok/s of each run: " + ", ".join(f"{r.tokens_per_s:.1f}" for r in runs))
        rss = llm_process_rss_mb()
    best = median_run(runs)
    model_bytes = sum(p.stat().st_size for p in (model_dir / ONNX_FILE).parent.iterdir())
    return VariantRow(variant, single, best.tokens_per_s, best.ttft_p50, best.ttft_p95, rss,
                      kv_bytes_per_token(model_dir), model_bytes / 1e6,
                      f"{greedy['identical']}/{greedy['prompts']}" if greedy else "?",
                      greedy["mean_tokens_to_first_difference"] if greedy else float("nan"),
                      sum(a.text == text for a, text in zip(alone, reference or reference_texts(requests))),
                      len(requests))


def reference_texts(requests: list[dict]) -> list[str]:
    """fp32 PyTorch greedy's answers to the requests, as text (computed once, cached: scripts/bench/peers.py)."""
    reference = peers.fp32_reference(requests, peers.prompt_ids(requests))
    return [peers.project_tokenizer().decode(ids) for ids in reference]


def run(variants: list[str], export_dir: Path, requests: list[dict], repeats: int,
        speculation: bool = True) -> list[VariantRow]:
    rows = []
    for variant in variants:
        model_dir = variant_dir(export_dir, variant)
        if not (model_dir / PARITY_REPORT_FILE).is_file():
            raise SystemExit(f"no {variant} variant at {model_dir}: run `make model QUANT={variant}`"
                             if variant != EXPORT_VARIANT else f"no export at {model_dir}: run `make model`")
        rows.append(measure(variant, model_dir, requests, repeats, speculation=speculation))
    return rows


def table(rows: list[VariantRow], n: int) -> str:
    base = next((r for r in rows if r.variant in (EXPORT_VARIANT, "fp32")), rows[0])  # export first when measured
    lines = [f"| variant | single-stream output tok/s | {n} concurrent output tok/s | TTFT p50 / p95 (s) | llm process "
             f"RSS (MiB) | KV bytes / token | model files (MB) | greedy identical over 64 tokens (mean tokens to "
             f"first difference) | greedy identical on this workload |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(
            f"| {r.variant} | {r.single_stream_tokens_per_s:.1f} (x{r.single_stream_tokens_per_s / base.single_stream_tokens_per_s:.2f}) "
            f"| {r.concurrent_tokens_per_s:.1f} (x{r.concurrent_tokens_per_s / base.concurrent_tokens_per_s:.2f}) "
            f"| {r.ttft_p50:.2f} / {r.ttft_p95:.2f} | {r.llm_rss_mb:.0f} | {r.kv_bytes_per_token:,} | {r.model_mb:.0f} "
            f"| {r.greedy_identical} ({r.mean_tokens_to_first_difference:.1f}) | {r.workload_identical}/{r.requests} |")
    return "\n".join(lines)


def comparison_table(rows: list[VariantRow], peer_rows: list[dict], n: int) -> str:
    """This server's variants and the peers on the same workload: output tokens without EOS for everyone."""
    lines = [f"| runner | one at a time: output tok/s | {n} at once: output tok/s | {n} at once: TTFT p50 (s) | "
             f"greedy identical to fp32 on this workload |", "| --- | --- | --- | --- | --- |"]
    for r in rows:
        name = "the export itself (fp32, padded cache)" if r.variant == EXPORT_VARIANT else f"`QUANT={r.variant}`"
        lines.append(f"| this server, {name} | {r.single_stream_tokens_per_s:.1f} | "
                     f"{r.concurrent_tokens_per_s:.1f} | {r.ttft_p50:.2f} | {r.workload_identical}/{r.requests} |")
    for p in peer_rows:
        if p["status"] != "measured":
            lines.append(f"| {p['peer']} | not built: `{p['build']}` | | | |")
            continue
        one, together = p["one_at_a_time"], p["all_at_once"]
        lines.append(f"| {p['peer']} | {one['answer_tokens'] / one['wall_s']:.1f} | "
                     f"{together['answer_tokens'] / together['wall_s']:.1f} | {together['ttft_p50']:.2f} | "
                     f"{one['identical']}/{p['requests']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default="export,fp32,int4,fast,fp16",
                        help=f"{EXPORT_VARIANT} is the export itself (fp32 on its own graph, the padded cache)")
    parser.add_argument("--export-dir", type=Path, default=EXPORT_DIR)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", type=Path, default=BUILD_DIR / "benchmark-variants.json")
    parser.add_argument("--peers", action="store_true", help="also llama.cpp's server and onnxruntime-genai's "
                                                             "generator on the same workload (scripts/bench/peers.py)")
    parser.add_argument("--no-speculation", action="store_true",
                        help="serve each variant with speculative_draft \"\" (plain decoding; by the config's "
                             "default fp32 and fp16 check the fast variant's drafts while a request decodes alone)")
    args = parser.parse_args(argv)
    variants = args.variants.split(",")
    unknown = set(variants) - {EXPORT_VARIANT, *QUANT_CHOICES}
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; choose from {(EXPORT_VARIANT, *QUANT_CHOICES)}")
    requests = workload(args.requests)
    rows = run(variants, args.export_dir, requests, args.repeats, speculation=not args.no_speculation)
    print(table(rows, args.requests))
    peer_rows = peers.peer_rows(requests) if args.peers else []
    if peer_rows:
        print("\n" + comparison_table(rows, peer_rows, args.requests))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"variants": [asdict(r) for r in rows], "peers": peer_rows}, indent=2))
    log(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
