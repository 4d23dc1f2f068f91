"""NVIDIA's aiperf against the OpenAI API, beside Locust's ChatStreamUser at the same concurrency, one server:

    python -m scripts.bench.aiperf_benchmark                      # QUANT=int4's folder, concurrency 1, 8, 32
    python -m scripts.bench.aiperf_benchmark --concurrency 8

For each concurrency, aiperf (from the client libraries' venv, `make clients`) sends streaming chat requests, greedy,
max_tokens fixed, the load tests' prompts (loadtests/prompts.jsonl), until --requests-per-user requests per user are
done; then Locust's ChatStreamUser runs the same prompts and max_tokens for as long as aiperf took. Both tools'
TTFT p50, ITL p50, requests/s and output tokens/s (each from the server's usage counts) are put side by side, prefix
caching off. aiperf's exports stay under --output (build/aiperf/c<N>/), Locust's CSVs beside them.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

from loadtests.sweep import locust_rows, run_locust, wait_idle
from loadtests.workload import DEFAULT_PROMPTS
from python_backend.model_files import MODEL_DIR_ENV
from scripts.bench.workload import log
from scripts.launcher.openai_server import running_openai_api
from scripts.launcher.model_control import SERVED_MODELS, reload_llm
from scripts.launcher.triton_server import running_server
from scripts.paths import BUILD_DIR, EXPORT_DIR, PROJECT_ROOT
from scripts.prepare.quantize import variant_dir

AIPERF = PROJECT_ROOT / ".venv-clients" / "bin" / "aiperf"
MAX_TOKENS = 64
AIPERF_TIMEOUT_S = 1800  # bounds a hung run only


def aiperf_prompts(source: Path, target: Path) -> Path:
    """The load tests' prompts in aiperf's single_turn format ({"text": ...} per line)."""
    lines = [json.dumps({"text": json.loads(raw)["text_input"]}) for raw in source.read_text().splitlines() if raw]
    target.write_text("\n".join(lines) + "\n")
    return target


def run_aiperf(url: str, model: str, model_dir: Path, concurrency: int, requests: int, prompts: Path,
               folder: Path) -> dict:
    """One aiperf profile run; returns its JSON export."""
    command = [str(AIPERF), "profile", "--model", model, "--url", url, "--endpoint-type", "chat", "--streaming",
               "--concurrency", str(concurrency), "--request-count", str(requests),
               "--warmup-request-count", str(concurrency), "--input-file", str(prompts),
               "--custom-dataset-type", "single_turn", "--extra-inputs", f"max_tokens:{MAX_TOKENS}",
               "--extra-inputs", "temperature:0", "--tokenizer", str(model_dir), "--use-server-token-count",
               "--output-artifact-dir", str(folder)]
    # aiperf reads a local tokenizer folder only with Hugging Face's offline mode off (nothing is downloaded: the
    # folder has tokenizer.json).
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    with open(folder.parent / f"aiperf-c{concurrency}.log", "w") as output:
        done = subprocess.run(command, env=env, stdout=output, stderr=subprocess.STDOUT, timeout=AIPERF_TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"aiperf exited with {done.returncode}: see {output.name}")
    return json.loads((folder / "profile_export_aiperf.json").read_text())


def measure(concurrency: int, args, ports, api_url: str, model: str, prompts: Path) -> dict:
    metrics_url, folder = f"127.0.0.1:{ports.metrics}", args.output / f"c{concurrency}"
    folder.mkdir(parents=True, exist_ok=True)
    wait_idle(metrics_url)
    export = run_aiperf(api_url, model, args.model_dir, concurrency, args.requests_per_user * concurrency, prompts,
                        folder)
    aiperf_s = export["benchmark_duration"]["avg"]
    log(f"c{concurrency}: aiperf took {aiperf_s:.1f} s; Locust for as long")
    wait_idle(metrics_url)
    prefix = args.output / f"locust-c{concurrency}"
    run_locust(prefix, "ChatStreamUser", concurrency, max(5, math.ceil(aiperf_s)), f"127.0.0.1:{ports.http}",
               f"127.0.0.1:{ports.grpc}", f"fixed:{MAX_TOKENS}", args.prompts, api_url)
    rows = locust_rows(prefix)
    whole = rows.get("chat_stream", {})
    if not int(whole.get("Request Count", 0)):
        raise RuntimeError(f"Locust completed no request at concurrency {concurrency} ({prefix}_stats.csv)")

    def locust_s(name: str, column: str) -> float | None:
        value = rows.get(name, {}).get(column)
        return float(value) / 1000 if value not in (None, "", "N/A") else None

    return {
        "concurrency": concurrency,
        "aiperf": {"requests": export["request_count"]["avg"],
                   "ttft_p50_s": export["time_to_first_token"]["p50"] / 1000,
                   "itl_p50_s": export["inter_token_latency"]["p50"] / 1000,
                   "requests_per_s": export["request_throughput"]["avg"],
                   "output_tokens_per_s": export["output_token_throughput"]["avg"],
                   "output_tokens_per_request": export["output_sequence_length"]["avg"],
                   "errors": export.get("error_summary") or []},
        # chat_stream's content size is the request's completion_tokens (its usage)
        "locust": {"requests": int(whole["Request Count"]), "failures": int(whole.get("Failure Count", 0)),
                   "ttft_p50_s": locust_s("chat_stream TTFT", "50%"), "itl_p50_s": locust_s("chat_stream ITL", "50%"),
                   "requests_per_s": float(whole["Requests/s"]),
                   "output_tokens_per_s": float(whole["Requests/s"]) * float(whole["Average Content Size"]),
                   "output_tokens_per_request": float(whole["Average Content Size"])},
    }


def print_table(cells: list[dict]) -> None:
    def ms(value) -> str:
        return "–" if value is None else f"{value * 1000:.0f}"

    print("| concurrency | tool | requests | TTFT p50 (ms) | ITL p50 (ms) | requests/s | output tokens/s | "
          "tokens per request |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for cell in cells:
        for tool in ("aiperf", "locust"):
            r = cell[tool]
            print(f"| {cell['concurrency']} | {tool} | {r['requests']:.0f} | {ms(r['ttft_p50_s'])} | "
                  f"{ms(r['itl_p50_s'])} | {r['requests_per_s']:.2f} | {r['output_tokens_per_s']:.1f} | "
                  f"{r['output_tokens_per_request']:.1f} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, default=variant_dir(EXPORT_DIR, "int4"))
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--requests-per-user", type=int, default=4)
    parser.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS)
    parser.add_argument("--output", type=Path, default=BUILD_DIR / "aiperf")
    args = parser.parse_args(argv)
    if not AIPERF.exists():
        print("aiperf is not installed: make clients", file=sys.stderr)
        return 2
    args.output.mkdir(parents=True, exist_ok=True)
    prompts = aiperf_prompts(args.prompts, args.output / "prompts.jsonl")
    settings = json.loads((args.model_dir / "llm_settings.json").read_text())
    cells = []
    with running_server(log_path=args.output / "server.log", explicit_models=SERVED_MODELS,
                        env={MODEL_DIR_ENV: str(args.model_dir)}) as ports, \
            running_openai_api(f"127.0.0.1:{ports.grpc}", args.model_dir, args.output / "openai-api.log",
                               log_level="warning") as api_url:
        # Prefix caching off: each tool would otherwise find the prompts the other (or its own warm-up) sent cached.
        reload_llm(f"127.0.0.1:{ports.http}", enable_kv_cache_reuse="false")
        for concurrency in (int(c) for c in args.concurrency.split(",")):
            cells.append(measure(concurrency, args, ports, api_url, settings["model_name"], prompts))
    (args.output / "results.json").write_text(json.dumps(cells, indent=2))
    print_table(cells)
    print(f"\n(written to {args.output / 'results.json'}; aiperf's exports in {args.output}/c<N>/)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
