"""The main job: serve the exported model with a real tritonserver, send the demo prompts concurrently, print
each answer and a summary, stop the server. Exits non-zero on any failure.

    python -m scripts.clients.demo [--protocol grpc] [--concurrency 16]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from python_backend.model_files import ModelSettings
from scripts.clients.client import load_requests, run, summary
from scripts.clients.llm_client import PROTOCOLS, make_client
from scripts.launcher.triton_server import running_server
from scripts.paths import BUILD_DIR, default_model_dir

DEMO_PROMPTS = Path(__file__).resolve().parent / "demo_prompts.jsonl"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=Path, default=DEMO_PROMPTS)
    parser.add_argument("--protocol", choices=PROTOCOLS, default="http")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--server-log", type=Path, default=BUILD_DIR / "demo-server.log")
    args = parser.parse_args(argv)
    requests = load_requests(args.prompts, default_max_tokens=64)
    args.server_log.parent.mkdir(parents=True, exist_ok=True)
    print(f"starting tritonserver (log: {args.server_log}) ...", flush=True)
    with running_server(log_path=args.server_log) as ports:
        print(f"ready on 127.0.0.1: HTTP {ports.http}, gRPC {ports.grpc}, metrics {ports.metrics}", flush=True)
        print(f"sending {len(requests)} prompts over {args.protocol}, {args.concurrency} at a time ...", flush=True)
        client = make_client(args.protocol, f"127.0.0.1:{ports.http}", f"127.0.0.1:{ports.grpc}")
        records, wall_s = run(requests, client, args.concurrency)
    for i, record in enumerate(records, 1):
        print(f"\n[{i}] {record['text_input']}")
        if "error" in record:
            print(f"  ERROR: {record['error']}")
        else:
            print(f"  -> {record['text_output']}")
            print(f"  ({record['output_tokens']} tokens, {record['latency_s']:.2f} s)")
    settings = ModelSettings.load(default_model_dir())
    print("\n" + summary(records, wall_s) + f"; model {settings.model_name}, {settings.quantization} weights")
    return 1 if any("error" in r for r in records) else 0


if __name__ == "__main__":
    sys.exit(main())
