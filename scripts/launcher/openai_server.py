"""Run the OpenAI-compatible API (openai_api/) in front of a running tritonserver.

    python -m scripts.launcher.openai_server --triton-url 127.0.0.1:8001 --model-dir build/model --port 9000

`make serve` starts it beside tritonserver (scripts/launcher/triton_server.py, `--openai-port`, `--no-openai`). Stops on
Ctrl-C / SIGTERM (open streams get a few seconds)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import uvicorn

from openai_api.auth import KEYS_ENV, keys_from_environment
from python_backend.lora import parse_modules
from python_backend.serving.llm_adapters import LORA_MODULES_ENV
from openai_api.batch.config import DATA_DIR_ENV, DEFAULT_DATA_DIR, BatchConfig
from scripts.launcher.processes import Ports, terminate
from scripts.paths import PROJECT_ROOT, default_model_dir

DEFAULT_PORT = 9000


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="OpenAI-compatible HTTP API in front of Triton's ensemble model.")
    parser.add_argument("--triton-url", default="127.0.0.1:8001", help="tritonserver's gRPC host:port")
    parser.add_argument("--model-dir", type=Path, default=default_model_dir(),
                        help="the exported model folder: tokenizer, chat template (default: $TRITON_LLM_MODEL_DIR or "
                             "build/model)")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT)
    parser.add_argument("--served-model-name", help="the model id clients use (default: llm_settings.json's)")
    parser.add_argument("--health-url", help="also required to answer 200 for /health/ready (the supervisor's)")
    parser.add_argument("--default-max-tokens", type=int,
                        help="chat requests without max_tokens (default: the rest of the context)")
    parser.add_argument("--api-key", action="append", default=[],
                        help="a key clients must send (Authorization: Bearer); repeatable. Also read, comma-separated, "
                             f"from ${KEYS_ENV} (launchers pass keys so, never on a command line) and from the file "
                             "$TRITON_LLM_API_KEYS_FILE names (a mounted Secret). "
                             "None: the API is open (keep it on loopback)")
    parser.add_argument("--data-dir", type=Path, default=Path(os.environ.get(DATA_DIR_ENV) or DEFAULT_DATA_DIR),
                        help=f"the Batch API's database and files (default: ${DATA_DIR_ENV}, else build/batches, "
                             "which make clean keeps)")
    parser.add_argument("--batch-concurrency", type=int, default=BatchConfig.concurrency,
                        help="batch lines in flight (default: the llm model's max_batch_size 32 minus its "
                             "priority_reserved_slots 2)")
    parser.add_argument("--lora-modules", default=os.environ.get(LORA_MODULES_ENV, ""),
                        help="name=path,... : the LoRA adapters the llm model loads at start, served as models "
                             f"(default: ${LORA_MODULES_ENV}, which `make serve LORA_MODULES=...` sets)")
    parser.add_argument("--log-level", default="info")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.default_max_tokens is not None and args.default_max_tokens < 1:
        raise SystemExit("--default-max-tokens must be >= 1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # Imported here: huggingface_hub reads HF_HUB_OFFLINE when it is first imported.
    from openai_api.app import ServiceConfig, create_app

    keys = tuple(args.api_key) + keys_from_environment(os.environ)
    data_dir = args.data_dir if args.data_dir.is_absolute() else PROJECT_ROOT / args.data_dir
    app = create_app(ServiceConfig(triton_url=args.triton_url, model_dir=args.model_dir,
                                   served_model_name=args.served_model_name, health_url=args.health_url,
                                   default_max_tokens=args.default_max_tokens, api_keys=keys,
                                   lora_modules=tuple(parse_modules(args.lora_modules).items()),
                                   batch=BatchConfig(data_dir=data_dir, concurrency=args.batch_concurrency)))
    if not keys and args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"WARNING: the OpenAI API listens on {args.host} without API keys: anyone who reaches the port can use "
              f"it and read its batches; set --api-key or ${KEYS_ENV}", flush=True)
    print(f"openai api: http://{args.host}:{args.port}/v1 -> Triton gRPC {args.triton_url}", flush=True)
    # No access log: one line per request on a 2-core machine that also runs the model.
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False,
                timeout_graceful_shutdown=5)
    return 0


@contextmanager
def running_openai_api(triton_url: str, model_dir: Path, log_path: Path, ready_timeout_s: float = 120,
                       log_level: str = "info", data_dir: Path | None = None, api_keys: tuple[str, ...] = (),
                       port: int | None = None, extra_args: tuple[str, ...] = ()):
    """This service in a subprocess on a free loopback port (or ``port``), in front of triton_url, until the block
    ends; yields its base URL (http://127.0.0.1:PORT) once /health/ready answers 200. Its Batch API data goes to
    ``data_dir`` (default: a folder beside the log). Keys travel in the environment, never in the command line.
    Used by the benchmark, the sweep and the tests."""
    process, url = start_openai_api(triton_url, model_dir, log_path, ready_timeout_s, log_level, data_dir, api_keys,
                                    port, extra_args)
    try:
        yield url
    finally:
        terminate(process, 30)


def start_openai_api(triton_url: str, model_dir: Path, log_path: Path, ready_timeout_s: float = 120,
                     log_level: str = "info", data_dir: Path | None = None, api_keys: tuple[str, ...] = (),
                     port: int | None = None, extra_args: tuple[str, ...] = ()) -> tuple[subprocess.Popen, str]:
    """running_openai_api's process, left to the caller (a test that kills it); it is ready when this returns."""
    port = port or Ports.free().http
    url = f"http://127.0.0.1:{port}"
    data_dir = data_dir or log_path.parent / "openai-data"
    env = {**os.environ, KEYS_ENV: ",".join(api_keys)}
    with open(log_path, "a") as log:
        process = subprocess.Popen([sys.executable, "-m", "scripts.launcher.openai_server", "--triton-url", triton_url,
                                    "--model-dir", str(model_dir), "--port", str(port), "--log-level", log_level,
                                    "--data-dir", str(data_dir), *extra_args],
                                   cwd=PROJECT_ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + ready_timeout_s
        while not answers_200(f"{url}/health/ready"):
            if process.poll() is not None:
                raise RuntimeError(f"the OpenAI API exited with code {process.returncode}; see {log_path}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the OpenAI API was not ready within {ready_timeout_s:.0f} s; see {log_path}")
            time.sleep(0.25)
    except BaseException:
        terminate(process, 30)
        raise
    return process, url


def answers_200(url: str) -> bool:
    """Whether a GET of url answers 200 (anything else, or nothing, is False)."""
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status == 200
    except OSError:
        return False


if __name__ == "__main__":
    sys.exit(main())
