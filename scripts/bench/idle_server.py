"""What an idle server costs: a tritonserver with this project's models started on a model folder, left without
requests, and the CPU seconds each of its processes used over a window (its watchers' threads: heartbeats, the
cancellation watch, the front's watchdog).

    python -m scripts.bench.idle_server --model-dir build/model-fp32 --seconds 30

The suite's shared servers stay up, idle most of the time, until their worker's session ends (docs/testing.md)."""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from scripts.bench.benchmark import cpu_line, cpu_seconds
from scripts.launcher.triton_server import all_models, running_server
from scripts.paths import MODEL_REPOSITORY, default_model_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, default=default_model_dir())
    parser.add_argument("--seconds", type=float, default=30.0, help="the measured window (after a 5 s settle)")
    args = parser.parse_args(argv)
    log = Path(tempfile.mkdtemp(prefix="idle-server-")) / "server.log"
    with running_server(MODEL_REPOSITORY, log_path=log, explicit_models=all_models(MODEL_REPOSITORY),
                        env={"TRITON_LLM_MODEL_DIR": str(args.model_dir.resolve())}):
        time.sleep(5)  # the models' start-up work is over
        before = cpu_seconds()
        time.sleep(args.seconds)
        after = cpu_seconds()
    print(cpu_line(before, after, args.seconds))
    server = sum(after[name] - before.get(name, 0.0) for name in after if name != "benchmark client")
    print(f"the server: {server:.2f} CPU-s in {args.seconds:.0f} s idle, {100 * server / args.seconds:.1f} % of a core "
          f"(its log: {log})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
