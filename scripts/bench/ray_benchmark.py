"""Ray Data (scripts/ray_batch.py) against the plain batch runner (scripts.run_batch), one run (about 7 minutes here):

    python -m scripts.bench.ray_benchmark                  # QUANT=int4's folder, 1024 lines
    python -m scripts.bench.ray_benchmark --lines 256      # shorter (Ray's start weighs more)

The same file of N greedy chat lines (the benchmark's prompts, max_tokens 16) through scripts.run_batch on one server,
through Ray on that server, and through Ray on two servers on this machine: output tokens/s of each, Ray's ratio to
run_batch on the same server, and two servers' ratio to one. The two servers share this machine's cores, so their
ratio measures Ray's fan-out (every line once, both servers busy), not what a second machine would add: on the 2-core
machine one server already uses both cores at a full batch. Ray's wall time includes its job's start (the actors,
the /v1/models calls), not ray.init. Writes build/benchmark-ray.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import httpx2 as httpx
import ray

from python_backend.model_files import MODEL_DIR_ENV
from scripts import ray_batch
from scripts.bench.workload import log, workload
from scripts.clients import run_batch
from scripts.launcher.openai_server import running_openai_api
from scripts.launcher.triton_server import running_server
from scripts.paths import BUILD_DIR, EXPORT_DIR
from scripts.prepare.quantize import variant_dir

MAX_TOKENS = 16


def batch_file(path: Path, model: str, n: int) -> Path:
    lines = [{"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": model, "messages": [{"role": "user", "content": r["text_input"]}],
                       "max_tokens": MAX_TOKENS, "temperature": 0}} for i, r in enumerate(workload(n))]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    return path


def answers(paths) -> tuple[dict[str, str], int, int]:
    """custom_id -> answer text of the output lines in paths; output tokens; error lines."""
    texts, tokens, errors = {}, 0, 0
    for path in paths:
        for raw in Path(path).read_text(encoding="utf-8").splitlines():
            record = json.loads(raw)
            if record["error"] or record["response"]["status_code"] != 200:
                errors += 1
                continue
            body = record["response"]["body"]
            texts[record["custom_id"]] = body["choices"][0]["message"]["content"]
            tokens += body["usage"]["completion_tokens"]
    return texts, tokens, errors


def timed(name: str, call) -> float:
    started = time.perf_counter()
    code = call()
    wall = time.perf_counter() - started
    if code != 0:
        raise RuntimeError(f"{name} exited {code}")
    return wall


def run(model_dir: Path, n: int) -> dict:
    out = BUILD_DIR / "benchmark-ray"
    out.mkdir(parents=True, exist_ok=True)
    log(f"Ray Data against run_batch: {n} lines, max_tokens {MAX_TOKENS}, on {model_dir}")
    with ExitStack() as stack:
        urls = []
        for k in (1, 2):
            ports = stack.enter_context(running_server(log_path=BUILD_DIR / f"benchmark-ray-server{k}.log",
                                                       env={MODEL_DIR_ENV: str(model_dir)}))
            urls.append(stack.enter_context(running_openai_api(
                f"127.0.0.1:{ports.grpc}", model_dir, BUILD_DIR / f"benchmark-ray-api{k}.log",
                data_dir=out / f"api{k}")))
        model = httpx.get(f"{urls[0]}/v1/models").json()["data"][0]["id"]
        requests = batch_file(out / "input.jsonl", model, n)
        warm = batch_file(out / "warm.jsonl", model, 32)
        for url in urls:  # warm-up: each server's first batch
            run_batch.main(["-i", str(warm), "-o", str(out / "warm-out.jsonl"), "--url", url, "--overwrite"])
        ray_batch.init_ray(num_cpus=2, log_to_driver=False)

        rows = {}
        plain = out / "run_batch.jsonl"
        wall = timed("run_batch", lambda: run_batch.main(["-i", str(requests), "-o", str(plain), "--url", urls[0],
                                                          "--overwrite"]))
        rows["run_batch, 1 server"] = (wall, *answers([plain]))
        for count in (1, 2):
            folder = out / f"ray-{count}"
            wall = timed(f"ray on {count}", lambda: ray_batch.main(
                ["--input", str(requests), "--output", str(folder), "--servers", ",".join(urls[:count]),
                 "--overwrite"]))
            rows[f"Ray Data, {count} server{'s' * (count > 1)}"] = (wall, *answers(sorted(folder.glob("part-*"))))
        ray.shutdown()

    reference = rows["run_batch, 1 server"][1]
    result = {"lines": n, "max_tokens": MAX_TOKENS, "model_dir": str(model_dir), "rows": []}
    for name, (wall, texts, tokens, errors) in rows.items():
        result["rows"].append({"runner": name, "wall_s": round(wall, 2), "output_tokens": tokens,
                               "tokens_per_s": round(tokens / wall, 1), "lines_done": len(texts),
                               "lines_failed": errors,
                               "same_as_run_batch": sum(texts.get(k) == v for k, v in reference.items())})
    plain_rate, one, two = (row["tokens_per_s"] for row in result["rows"])
    result["ray_over_run_batch"] = round(one / plain_rate, 3)
    result["two_over_one"] = round(two / one, 3)
    return result


def print_table(result: dict) -> None:
    print(f"\n{result['lines']} greedy chat lines, max_tokens {result['max_tokens']}\n")
    print("| runner | wall s | output tokens | output tokens/s | lines done / failed | answers equal to run_batch's |")
    print("| --- | --- | --- | --- | --- | --- |")
    for row in result["rows"]:
        print(f"| {row['runner']} | {row['wall_s']:.1f} | {row['output_tokens']} | {row['tokens_per_s']:.1f} | "
              f"{row['lines_done']} / {row['lines_failed']} | {row['same_as_run_batch']}/{result['lines']} |")
    print(f"\nRay on 1 server / run_batch on it: {result['ray_over_run_batch']:.2f}; "
          f"Ray on 2 servers / Ray on 1: {result['two_over_one']:.2f} (both servers on the same 2 cores)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, default=variant_dir(EXPORT_DIR, "int4"))
    parser.add_argument("--lines", type=int, default=1024)
    parser.add_argument("--output", type=Path, default=BUILD_DIR / "benchmark-ray.json")
    args = parser.parse_args(argv)
    result = run(args.model_dir, args.lines)
    args.output.write_text(json.dumps(result, indent=2))
    print_table(result)
    print(f"\n(written to {args.output})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
