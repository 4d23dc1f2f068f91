"""Sweep max_batch_size x strategy x concurrency with Locust against the real server; write CSV/JSON results, PNG
plots and a Markdown report naming the best configuration within a latency budget.

    python -m loadtests.sweep --quick                  # 4 cells, about 1.5 minutes
    python -m loadtests.sweep                          # 6 batch sizes x 3 strategies x 3 concurrencies, < 15 min
    python -m loadtests.sweep --batch-sizes 4,16 --strategies continuous --concurrency 8,32 --duration 20

Each (max_batch_size, strategy) is applied to the running server without a restart (explicit model control: the
llm model is loaded again with a config override). For each concurrency level, Locust runs headless for --duration
seconds with that many users (each sends its next request when the previous answer is complete); with
`--user ChatStreamUser` the sweep also starts the OpenAI-compatible service (scripts/launcher/openai_server.py) in
front of its server. Latency, TTFT and ITL come from Locust's own CSV; output tokens/s from the llm model's token
counter; queue times and batch sizes from Triton's statistics API and the engine's batch-size histogram.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import subprocess
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from loadtests.workload import DEFAULT_PROMPTS, MaxTokens
from python_backend.runtime.factory import RUNTIMES
from scripts.launcher.model_control import SERVED_MODELS, reload_llm
from scripts.launcher.openai_server import running_openai_api
from scripts.launcher.render_model_repository import repository_for
from scripts.launcher.server_metrics import read_metrics
from scripts.launcher.triton_server import running_server
from scripts.paths import BUILD_DIR, PROJECT_ROOT, default_model_dir

LOCUSTFILE = Path(__file__).resolve().parent / "locustfile.py"
ENTRIES = {"StreamUser": "generate_stream", "GrpcStreamUser": "grpc_stream", "ChatStreamUser": "chat_stream"}
STOP_TIMEOUT_S = 60


@dataclass
class Cell:
    strategy: str
    max_batch_size: int
    concurrency: int
    duration_s: float
    requests: int
    failures: int
    requests_per_s: float
    output_tokens_per_s: float
    latency_p50_s: float
    latency_p95_s: float
    latency_p99_s: float
    ttft_p50_s: float
    ttft_p95_s: float
    itl_p50_s: float
    triton_llm_queue_ms: float  # Triton's queue before the llm model's execute(), per request
    triton_ensemble_queue_ms: float
    triton_llm_requests_per_execute: float
    engine_mean_batch_size: float  # sequences per decode step, from the engine's histogram
    locust_csv: str


def log(message: str) -> None:
    print(f"[sweep] {message}", file=sys.stderr, flush=True)


def locust_rows(prefix: Path) -> dict[str, dict[str, str]]:
    with open(f"{prefix}_stats.csv", newline="") as handle:
        return {row["Name"]: row for row in csv.DictReader(handle)}


def run_locust(prefix: Path, user: str, concurrency: int, duration_s: float, http: str, grpc: str,
               max_tokens: str, prompts: Path, openai_url: str | None = None) -> None:
    command = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), user, "--headless", "--only-summary",
               "-u", str(concurrency), "-r", str(concurrency), "-t", f"{duration_s:g}s", "--host", f"http://{http}",
               "--grpc-url", grpc, "--csv", str(prefix), "--max-tokens", max_tokens, "--prompts", str(prompts),
               # When the time is up, users finish the request they are waiting for, so that slow requests are
               # measured instead of dropped (a cut-off cell would report only the requests fast enough to finish).
               "--stop-timeout", str(STOP_TIMEOUT_S), "--loglevel", "WARNING"]
    if openai_url:
        command += ["--openai-url", openai_url]
    result = subprocess.run(command, cwd=PROJECT_ROOT, capture_output=True, text=True,
                            timeout=duration_s + STOP_TIMEOUT_S + 120)
    if result.returncode not in (0, 1):  # 1: some requests failed; they are counted in the CSV. 2: no endpoint
        raise RuntimeError(f"locust exited with {result.returncode}: {result.stderr[-2000:]}")


def openai_service(grpc_port: int, log_path: Path, model_dir: Path | None = None, timeout_s: float = 120):
    """The OpenAI-compatible service (scripts/launcher/openai_server.py) in front of a local server, on a free port; a
    context that yields its URL. model_dir: the exported model (default: $TRITON_LLM_MODEL_DIR or build/model)."""
    model_dir = model_dir or default_model_dir()
    return running_openai_api(f"127.0.0.1:{grpc_port}", model_dir, log_path, timeout_s, log_level="warning")


def triton_stats(http: str) -> dict[str, dict]:
    import tritonclient.http as httpclient

    stats = httpclient.InferenceServerClient(http).get_inference_statistics()
    return {m["name"]: m for m in stats["model_stats"]}


def _queue_ms(before: dict, after: dict) -> float:
    count = after["inference_stats"]["queue"]["count"] - before["inference_stats"]["queue"]["count"]
    ns = after["inference_stats"]["queue"]["ns"] - before["inference_stats"]["queue"]["ns"]
    return ns / count / 1e6 if count else 0.0


def wait_idle(metrics: str, timeout_s: float = 120) -> None:
    """Waits until the previous cell's requests (cancelled when Locust stopped) have left the engine."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        values = read_metrics(metrics)
        if values.get("llm_running_sequences", 0) + values.get("llm_waiting_sequences", 0) == 0:
            return
        time.sleep(0.2)
    log("WARNING: the engine did not drain before the next cell")


def measure_cell(strategy, batch_size, concurrency, args, ports, cell_dir, openai_url=None) -> Cell:
    http, grpc, metrics = (f"127.0.0.1:{p}" for p in (ports.http, ports.grpc, ports.metrics))
    wait_idle(metrics)
    stats_before, engine_before = triton_stats(http), read_metrics(metrics, strategy=strategy)
    prefix = cell_dir / f"{strategy}-bs{batch_size}-c{concurrency}"
    started = time.monotonic()
    run_locust(prefix, args.user, concurrency, args.duration, http, grpc, args.max_tokens, args.prompts, openai_url)
    elapsed = time.monotonic() - started
    stats_after, engine_after = triton_stats(http), read_metrics(metrics, strategy=strategy)
    rows = locust_rows(prefix)
    entry = ENTRIES[args.user]
    # A cell in which no request completed has no row for it: it is recorded with zeros, not dropped.
    main, ttft, itl = (rows.get(name, {}) for name in (entry, f"{entry} TTFT", f"{entry} ITL"))

    def seconds(row, column):
        value = row.get(column)
        return float(value) / 1000 if value not in (None, "", "N/A") else 0.0

    def delta(name):
        return engine_after.get(name, 0.0) - engine_before.get(name, 0.0)

    requests, requests_per_s = int(main.get("Request Count", 0)), float(main.get("Requests/s", 0))
    # Locust's own span, from its users' start to the last answer (its Requests/s is requests over it): not the
    # process's start-up, nor its wait at exit for its CSV files to hold the end (loadtests/locustfile.py)
    span = requests / requests_per_s if requests and requests_per_s else elapsed

    llm_before, llm_after = stats_before["llm"], stats_after["llm"]
    inferences = llm_after["inference_count"] - llm_before["inference_count"]
    executions = llm_after["execution_count"] - llm_before["execution_count"]
    steps = delta("llm_batch_size_count")
    return Cell(
        strategy=strategy, max_batch_size=batch_size, concurrency=concurrency, duration_s=args.duration,
        requests=requests, failures=int(main.get("Failure Count", 0)), requests_per_s=requests_per_s,
        output_tokens_per_s=delta("llm_output_tokens_total") / span,
        latency_p50_s=seconds(main, "50%"), latency_p95_s=seconds(main, "95%"), latency_p99_s=seconds(main, "99%"),
        ttft_p50_s=seconds(ttft, "50%"), ttft_p95_s=seconds(ttft, "95%"), itl_p50_s=seconds(itl, "50%"),
        triton_llm_queue_ms=_queue_ms(llm_before, llm_after),
        triton_ensemble_queue_ms=_queue_ms(stats_before["ensemble"], stats_after["ensemble"]),
        triton_llm_requests_per_execute=inferences / executions if executions else 0.0,
        engine_mean_batch_size=delta("llm_batch_size_sum") / steps if steps else 0.0,
        locust_csv=str(prefix.relative_to(cell_dir.parent)) + "_stats.csv",
    )


def machine() -> str:
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} cores, {platform.system()} {platform.release()}"


def best_within(cells: list[Cell], budget_s: float) -> Cell | None:
    fitting = [c for c in cells if c.failures == 0 and c.requests and c.latency_p95_s <= budget_s]
    return max(fitting, key=lambda c: c.output_tokens_per_s, default=None)


def pareto_front(cells: list[Cell]) -> list[Cell]:
    """The cells no other cell beats on both throughput and p95 latency, by rising throughput: the best
    latency-throughput trade-offs, the curve worth drawing."""
    front: list[Cell] = []
    for cell in sorted(cells, key=lambda c: (-c.output_tokens_per_s, c.latency_p95_s)):
        if not front or cell.latency_p95_s < front[-1].latency_p95_s:
            front.append(cell)
    return front[::-1]


def plot(cells: list[Cell], output: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    strategies = sorted({c.strategy for c in cells})
    top = max(c.concurrency for c in cells)
    paths = []

    def at_top(strategy):
        return sorted((c for c in cells if c.strategy == strategy and c.concurrency == top),
                      key=lambda c: c.max_batch_size)

    for name, ylabel, series in [
        ("latency_vs_batch_size.png", "seconds", [("latency_p95_s", "-", "p95 latency"),
                                                  ("ttft_p95_s", "--", "p95 TTFT")]),
        ("throughput_vs_batch_size.png", "output tokens/s", [("output_tokens_per_s", "-", "")]),
    ]:
        figure, axes = plt.subplots(figsize=(7, 4.5))
        for strategy in strategies:
            points = at_top(strategy)
            for field, style, label in series:
                axes.plot([c.max_batch_size for c in points], [getattr(c, field) for c in points], style,
                          marker="o", label=f"{strategy} {label}".strip())
        axes.set_xscale("log", base=2)
        axes.set_xlabel("max_batch_size")
        axes.set_ylabel(ylabel)
        axes.set_title(f"{ylabel} vs max_batch_size at concurrency {top}")
        axes.grid(True, alpha=0.3)
        axes.legend()
        figure.tight_layout()
        figure.savefig(output / name, dpi=110)
        plt.close(figure)
        paths.append(output / name)

    figure, axes = plt.subplots(figsize=(7, 4.5))
    for strategy in strategies:
        points = [c for c in cells if c.strategy == strategy]
        front = pareto_front(points)
        line, = axes.plot([c.output_tokens_per_s for c in front], [c.latency_p95_s for c in front], marker="o",
                          linestyle="-", label=f"{strategy} (best trade-offs)")
        axes.scatter([c.output_tokens_per_s for c in points], [c.latency_p95_s for c in points], s=14,
                     color=line.get_color(), alpha=0.35)
        for c in front:
            axes.annotate(f"b{c.max_batch_size}/c{c.concurrency}", (c.output_tokens_per_s, c.latency_p95_s),
                          fontsize=6, alpha=0.8)
    axes.set_xlabel("output tokens/s")
    axes.set_ylabel("p95 request latency (s)")
    axes.set_title("latency-throughput: all cells (dots), each strategy's Pareto front (line)")
    axes.grid(True, alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(output / "latency_throughput.png", dpi=110)
    plt.close(figure)
    paths.append(output / "latency_throughput.png")
    return paths


def report(cells: list[Cell], args, output: Path, wall_s: float) -> str:
    best = best_within(cells, args.latency_budget)
    lines = [
        "# Sweep report", "",
        f"- machine: {machine()}",
        f"- workload: {args.prompts.name}, max_tokens {args.max_tokens}, Locust user {args.user}, "
        f"{args.duration:g} s of new requests per cell, {len(cells)} cells in {wall_s / 60:.1f} min",
        f"- latency budget: p95 request latency <= {args.latency_budget:g} s", "",
    ]
    if best:
        lines.append(f"**Best within the budget:** strategy `{best.strategy}`, max_batch_size {best.max_batch_size}, "
                     f"concurrency {best.concurrency}: {best.output_tokens_per_s:.1f} output tokens/s, "
                     f"p95 latency {best.latency_p95_s:.2f} s, p95 TTFT {best.ttft_p95_s:.2f} s.")
    else:
        fastest = min(cells, key=lambda c: c.latency_p95_s)
        lines.append(f"**No cell meets the budget.** The lowest p95 latency was {fastest.latency_p95_s:.2f} s "
                     f"(`{fastest.strategy}`, max_batch_size {fastest.max_batch_size}, concurrency "
                     f"{fastest.concurrency}).")
    lines += ["", "![latency vs batch size](latency_vs_batch_size.png)",
              "![throughput vs batch size](throughput_vs_batch_size.png)",
              "![latency-throughput](latency_throughput.png)", "",
              "| strategy | max_batch_size | concurrency | req/s | output tok/s | latency p50 / p95 / p99 (s) | "
              "TTFT p50 / p95 (s) | ITL p50 (ms) | llm queue (ms) | engine batch | failures |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for c in cells:
        lines.append(f"| {c.strategy} | {c.max_batch_size} | {c.concurrency} | {c.requests_per_s:.2f} | "
                     f"{c.output_tokens_per_s:.1f} | {c.latency_p50_s:.2f} / {c.latency_p95_s:.2f} / "
                     f"{c.latency_p99_s:.2f} | {c.ttft_p50_s:.2f} / {c.ttft_p95_s:.2f} | {c.itl_p50_s * 1000:.0f} | "
                     f"{c.triton_llm_queue_ms:.1f} | {c.engine_mean_batch_size:.1f} | {c.failures} |")
    lines += ["", "Latency, TTFT and ITL percentiles are Locust's (its CSV rounds them to two significant digits). "
              f"Users start requests for {args.duration:g} s, then finish the one in flight, so slow requests are "
              "counted too. Output tokens/s counts every token the engine generated from the cell's start to its "
              "last answer; the engine batch is the mean number of sequences per decode step. One short run per "
              "cell on a shared machine: differences of 10-20 % between neighbouring cells are noise."]
    text = "\n".join(lines) + "\n"
    (output / "report.md").write_text(text)
    return text


FULL = {"batch_sizes": "1,2,4,8,16,32", "strategies": "continuous,dynamic,static", "concurrency": "1,8,32"}
QUICK = {"batch_sizes": "1,8", "strategies": "continuous,static", "concurrency": "8"}


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="batch sizes 1,8; continuous and static; "
                                                             "concurrency 8 (each unless given)")
    parser.add_argument("--batch-sizes", help="default 1,2,4,8,16,32")
    parser.add_argument("--strategies", help="default continuous,dynamic,static")
    parser.add_argument("--concurrency", help="default 1,8,32")
    parser.add_argument("--duration", type=float, default=6.0,
                        help="seconds during which users start new requests, per cell")
    parser.add_argument("--user", default="StreamUser", choices=sorted(ENTRIES))
    parser.add_argument("--max-tokens", default="choice:16,32,64")
    parser.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS)
    parser.add_argument("--latency-budget", type=float, default=10.0, help="p95 request latency budget, seconds")
    parser.add_argument("--output", type=Path, default=BUILD_DIR / "sweep")
    parser.add_argument("--runtime", default="onnxruntime", choices=RUNTIMES, help="the server's llm runtime")
    args = parser.parse_args(argv)
    defaults = QUICK if args.quick else FULL
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    MaxTokens.parse(args.max_tokens)  # fail early on a bad distribution
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    strategies = args.strategies.split(",")
    levels = [int(c) for c in args.concurrency.split(",")]
    total = len(batch_sizes) * len(strategies) * len(levels)
    cell_dir = args.output / "locust"
    cell_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    cells: list[Cell] = []
    log(f"{total} cells, about {total * (args.duration + 8) / 60:.1f} min; starting tritonserver")
    with running_server(repository_for(args.runtime), log_path=args.output / "server.log",
                        explicit_models=SERVED_MODELS) as ports, \
            (openai_service(ports.grpc, args.output / "openai.log") if args.user == "ChatStreamUser"
             else nullcontext()) as openai_url:
        for strategy in strategies:
            for batch_size in batch_sizes:
                reload_llm(f"127.0.0.1:{ports.http}", max_batch_size=batch_size, batching_strategy=strategy,
                           static_batch_size=batch_size)
                for concurrency in levels:
                    cell = measure_cell(strategy, batch_size, concurrency, args, ports, cell_dir, openai_url)
                    cells.append(cell)
                    log(f"[{len(cells)}/{total}] {strategy:10s} bs={batch_size:<3d} c={concurrency:<3d} "
                        f"{cell.output_tokens_per_s:6.1f} tok/s  p95 {cell.latency_p95_s:5.2f} s  "
                        f"TTFT p95 {cell.ttft_p95_s:5.2f} s  ({time.monotonic() - started:.0f} s)")
    with open(args.output / "results.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=[f.name for f in fields(Cell)])
        writer.writeheader()
        writer.writerows(asdict(c) for c in cells)
    (args.output / "results.json").write_text(json.dumps([asdict(c) for c in cells], indent=2))
    plot(cells, args.output)
    print(report(cells, args, args.output, time.monotonic() - started))
    log(f"wrote {args.output}/report.md, results.csv, results.json and 3 plots")
    return 0


if __name__ == "__main__":
    sys.exit(main())
