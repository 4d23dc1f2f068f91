"""Short requests on every protocol at once, round after round: does the front model's process survive them?
(Triton 2.51's stub freed a finished BLS stream's tensors without the GIL and corrupted the front's heap:
python_backend/serving/spent_streams.py.)

    python -m scripts.bench.front_stress --minutes 5 --model-dir build/model-fp32

Each round sends one request per protocol at once (/generate, gRPC, gRPC streaming, /generate_stream), each with
stop strings, as tests/test_stop_strings.py does. It stops at the first round after which a model process of the
server has died, or after --minutes, and prints every 50th round."""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

from scripts.paths import PROJECT_ROOT, default_model_dir

PROMPT = "What is the capital of France?"
STOPS = [["France is"], ["aris"], ["", "Berlin"], ["", "What is"], ["Paris", "of Fr", "zzz"]]


def one_round(http: str, grpc: str, stop: list[str]) -> None:
    from scripts.clients.llm_client import GenerateClient, GenerateStreamClient, GrpcClient, GrpcStreamClient
    from tests.helpers import at_once

    request = {"apply_chat_template": True, "text_input": PROMPT, "max_tokens": 16, "stop_words": stop}
    clients = [GenerateClient(http, timeout_s=60), GrpcClient(grpc, timeout_s=60),
               GrpcStreamClient(grpc, timeout_s=60), GenerateStreamClient(http, timeout_s=60)]
    at_once(*(functools.partial(client.complete, request) for client in clients))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=5)
    parser.add_argument("--model-dir", type=Path, default=None)
    parser.add_argument("--log", type=Path, default=PROJECT_ROOT / "build" / "front-stress.log")
    args = parser.parse_args(argv)
    from python_backend.model_files import MODEL_DIR_ENV
    from scripts.launcher.processes import process_with_argument, zombie_children
    from scripts.launcher.triton_server import running_server

    model_dir = (args.model_dir or default_model_dir()).resolve()
    args.log.parent.mkdir(parents=True, exist_ok=True)
    with running_server(log_path=args.log, env={MODEL_DIR_ENV: str(model_dir)}) as ports:
        http, grpc = f"127.0.0.1:{ports.http}", f"127.0.0.1:{ports.grpc}"
        server_pid = process_with_argument(f"--http-port={ports.http}")
        if server_pid is None:
            raise RuntimeError(f"no tritonserver process with --http-port={ports.http}")
        started, rounds, failed = time.monotonic(), 0, 0
        while time.monotonic() - started < 60 * args.minutes:
            try:
                one_round(http, grpc, STOPS[rounds % len(STOPS)])
            except Exception as error:  # noqa: BLE001 - a dead front shows as a timeout first
                failed += 1
                print(f"round {rounds + 1}: {type(error).__name__}: {error}", flush=True)
            rounds += 1
            dead = zombie_children(server_pid)
            if dead:
                print(f"a model process died in round {rounds} ({dead}), after {time.monotonic() - started:.0f} s "
                      f"(its stacks: {args.log})")
                return 1
            if rounds % 50 == 0:
                print(f"round {rounds}: {time.monotonic() - started:.0f} s, {failed} failed rounds", flush=True)
    print(f"{rounds} rounds ({4 * rounds} requests) in {args.minutes:g} min, {failed} failed; every model process "
          "alive after each")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
