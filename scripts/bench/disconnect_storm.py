"""A client holding many streams killed, again and again: does the server free their sequences and keep its model
processes? (The front model's per-stream BLS cancel requests crashed its stub here: docs/operations.md.)

    python -m scripts.bench.disconnect_storm --rounds 60 --streams 30 --model-dir build/model-fp32

Each round starts a client process with --streams gRPC streams of a long request, kills it with SIGKILL once each
stream has text, then asks for a short answer. It stops at the first round whose streams or answer fail or after
which a model process of the server has died, and prints each round. `--client URL COUNT` is the client process
itself."""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from scripts.bench.workload import NEVER_WRITTEN
from scripts.paths import PROJECT_ROOT, default_model_dir

# 1000 tokens, its end id one the model never writes: it runs until cancelled
LONG_REQUEST = {"apply_chat_template": True, "text_input": "Tell me a very long story about a dragon.",
                "max_tokens": 1000, "end_id": NEVER_WRITTEN}


def hold_streams(url: str, count: int) -> None:
    """The client: `count` streams; prints "streaming" once each has text (or "not started" after 300 s)."""
    from scripts.clients.llm_client import GrpcStreamClient

    started = [threading.Event() for _ in range(count)]

    def stream(index):
        for _ in GrpcStreamClient(url, timeout_s=600).stream(LONG_REQUEST):
            started[index].set()

    for index in range(count):
        threading.Thread(target=stream, args=(index,), daemon=True).start()
    print("streaming" if all(event.wait(300) for event in started) else "not started", flush=True)
    threading.Event().wait()


def kill_a_client(url: str, count: int) -> None:
    """One round's client, killed with SIGKILL once its streams run."""
    client = subprocess.Popen([sys.executable, "-m", "scripts.bench.disconnect_storm", "--client", url, str(count)],
                              cwd=PROJECT_ROOT, stdout=subprocess.PIPE, text=True)
    try:
        line = client.stdout.readline().strip()
        if line != "streaming":
            raise RuntimeError(f"the client's streams did not start ({line or 'it exited'})")
    finally:
        client.send_signal(signal.SIGKILL)
        client.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--streams", type=int, default=30)
    parser.add_argument("--model-dir", type=Path, default=None)
    parser.add_argument("--log", type=Path, default=PROJECT_ROOT / "build" / "disconnect-storm.log")
    parser.add_argument("--client", nargs=2, metavar=("URL", "COUNT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.client:
        hold_streams(args.client[0], int(args.client[1]))
        return 0
    from python_backend.model_files import MODEL_DIR_ENV
    from scripts.clients.llm_client import GrpcClient, RequestError
    from scripts.launcher.processes import process_with_argument, zombie_children
    from scripts.launcher.triton_server import running_server

    model_dir = (args.model_dir or default_model_dir()).resolve()
    args.log.parent.mkdir(parents=True, exist_ok=True)
    with running_server(log_path=args.log, env={MODEL_DIR_ENV: str(model_dir)}) as ports:
        url = f"127.0.0.1:{ports.grpc}"
        server_pid = process_with_argument(f"--http-port={ports.http}")
        if server_pid is None:
            raise RuntimeError(f"no tritonserver process with --http-port={ports.http}")
        for round_ in range(1, args.rounds + 1):
            started = time.monotonic()
            try:
                kill_a_client(url, args.streams)
                started = time.monotonic()
                answer = GrpcClient(url, timeout_s=60).complete({"text_input": "Hi", "max_tokens": 4}).text
            except (RequestError, RuntimeError) as error:
                answer = f"failed: {error}"
            dead = zombie_children(server_pid)
            print(f"round {round_}: {args.streams} streams' client killed; the next answer in "
                  f"{time.monotonic() - started:.1f} s: {answer!r}; dead model processes: {dead or 'none'}", flush=True)
            if dead or answer.startswith("failed"):
                print(f"the server broke in round {round_} (its log: {args.log})")
                return 1
    print(f"{args.rounds} rounds, the server whole after each")
    return 0


if __name__ == "__main__":
    sys.exit(main())
