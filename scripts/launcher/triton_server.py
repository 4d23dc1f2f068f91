"""Start and stop the real `tritonserver` that PyPI's `nvidia-pytriton` wheel ships, on CPU.

    python -m scripts.launcher.triton_server --http-port 8000 --grpc-port 8001 --metrics-port 8002 --health-port 8003

Used by `make serve` (foreground, stops on Ctrl-C / SIGTERM), the demo and the test fixtures. Run as a command it
supervises the server (scripts/launcher/supervisor.py): readiness that sees dead model processes on the health port, and
recovery without a person; `--no-supervise` runs tritonserver alone. `--tritonserver PATH` runs another build
(NVIDIA's container) with its own backends and environment. Beside the server it runs the OpenAI-compatible API
(scripts/launcher/openai_server.py) on `--openai-port` (9000), pointed at the server's gRPC port and, when supervised, at the
supervisor's readiness, which starts it again if it dies; `--no-openai` leaves it out. It stops with the server.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import threading
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

from openai_api.auth import KEYS_ENV, parse_keys
from scripts.launcher.processes import Ports, stop, terminate
from scripts.launcher.render_model_repository import repository_for
from scripts.launcher.supervisor import Supervisor, python_models, serve_health
from scripts.paths import MODEL_REPOSITORY, PROJECT_ROOT


def _pytriton_dir() -> Path:
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("tritonserver comes from the `nvidia-pytriton` package: run `make venv`")
    return Path(list(spec.submodule_search_locations)[0]) / "tritonserver"


def prepare_python_backend() -> Path:
    """Puts the Python-backend stub for this interpreter where the backend looks for it; returns the
    backends directory. Idempotent."""
    triton = _pytriton_dir()
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = triton / "python_backend_stubs" / version / "triton_python_backend_stub"
    target = triton / "backends" / "python" / "triton_python_backend_stub"
    if not target.exists():
        shutil.copy2(stub, target)
    return triton / "backends"


def server_environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != KEYS_ENV}  # the OpenAI API's keys are none of its business
    # The stub takes sys.prefix from the first python3 on PATH, so the venv's packages are importable in models.
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    libs = [
        sysconfig.get_config_var("LIBDIR"),  # the stub links libpython3.X.so of the venv's base Python
        str(_pytriton_dir().parent.parent / "nvidia_pytriton.libs"),
    ]
    env["LD_LIBRARY_PATH"] = os.pathsep.join(libs + [env.get("LD_LIBRARY_PATH", "")])
    # glibc writes its fatal messages (heap corruption, then abort) to the terminal, of which a server has none:
    # to stderr instead, so that they reach the server's log beside faulthandler's Python stacks.
    env.setdefault("LIBC_FATAL_STDERR_", "1")
    return env


def server_command(
    model_repository: Path,
    ports: Ports,
    address: str = "127.0.0.1",
    explicit_models: list[str] | None = None,
    extra_args: list[str] = (),
    binary: str | None = None,
) -> list[str]:
    """binary: a tritonserver with its own backends (NVIDIA's container); None: the one in nvidia-pytriton."""
    if binary:
        command = [binary, f"--model-repository={model_repository}"]
    else:
        command = [
            str(_pytriton_dir() / "bin" / "tritonserver"),
            f"--model-repository={model_repository}",
            f"--backend-directory={prepare_python_backend()}",
        ]
    command += [
        f"--http-address={address}",
        f"--grpc-address={address}",
        f"--metrics-address={address}",
        f"--http-port={ports.http}",
        f"--grpc-port={ports.grpc}",
        f"--metrics-port={ports.metrics}",
        "--exit-timeout-secs=5",
        "--log-verbose=0",
        # The repository's configs are complete: auto-complete would start a stub per Python model, before its
        # instance's, only to read them back unchanged (ready in 1.8 s instead of 3.3 s; docs/testing.md).
        "--disable-auto-complete-config",
    ]
    if explicit_models is not None:
        command.append("--model-control-mode=explicit")
        command += [f"--load-model={name}" for name in explicit_models]
    return command + list(extra_args)


def wait_until_ready(process: subprocess.Popen, ports: Ports, timeout_s: float, address: str = "127.0.0.1") -> None:
    """Until Triton says ready and its metrics port answers too (it opens a moment after the ready answer: a caller
    whose first look is at the metrics would be refused)."""
    urls = [f"http://{address}:{ports.http}/v2/health/ready", f"http://{address}:{ports.metrics}/metrics"]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"tritonserver exited with code {process.returncode} before it was ready")
        try:
            for url in urls:
                with urllib.request.urlopen(url, timeout=1) as response:
                    if response.status != 200:
                        raise OSError(f"{url}: HTTP {response.status}")
            return
        except OSError:
            pass
        time.sleep(0.25)
    raise TimeoutError(f"tritonserver was not ready within {timeout_s:.0f} s ({urls[0]}, {urls[1]})")


@contextmanager
def running_server(
    model_repository: Path = MODEL_REPOSITORY,
    ports: Ports | None = None,
    log_path: Path | None = None,
    ready_timeout_s: float = 180,
    explicit_models: list[str] | None = None,
    env: dict[str, str] | None = None,
):
    """A tritonserver on loopback for the duration of the block; yields its Ports."""
    ports = ports or Ports.free()
    log = open(log_path, "w") if log_path else subprocess.DEVNULL
    process = subprocess.Popen(
        server_command(model_repository, ports, explicit_models=explicit_models),
        env={**server_environment(), **(env or {})},
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_until_ready(process, ports, ready_timeout_s)
        yield ports
    finally:
        stop(process)
        if log_path:
            log.close()


def all_models(model_repository: Path) -> list[str]:
    return sorted(path.parent.name for path in Path(model_repository).glob("*/config.pbtxt"))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Run tritonserver in the foreground with this project's models.")
    parser.add_argument("--model-repository", type=Path, default=MODEL_REPOSITORY)
    parser.add_argument("--runtime", help="the llm model's runtime (onnxruntime-cuda, onnxruntime-tensorrt, tensorrt): "
                        "serves a copy of the repository rendered for it (scripts/launcher/render_model_repository.py)")
    parser.add_argument("--address", default="127.0.0.1", help="bind address (default: loopback only)")
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument("--grpc-port", type=int, default=8001)
    parser.add_argument("--metrics-port", type=int, default=8002)
    parser.add_argument("--health-port", type=int, default=8003, help="the supervisor's /health/ready and /health/live")
    parser.add_argument("--no-supervise", action="store_true", help="run tritonserver alone: no recovery, no health port")
    parser.add_argument("--tritonserver", help="path of another tritonserver build (default: nvidia-pytriton's)")
    parser.add_argument("--openai-port", type=int, default=9000, help="the OpenAI-compatible API's port")
    parser.add_argument("--no-openai", action="store_true", help="do not run the OpenAI-compatible API")
    parser.add_argument("--api-key", action="append", default=[],
                        help="a key the OpenAI API requires (repeatable; also comma-separated in $TRITON_LLM_API_KEYS, "
                             "which `make serve OPENAI_API_KEY=k1,k2` sets); passed to it in the environment")
    parser.add_argument("extra", nargs="*", help="more tritonserver flags, after --")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.runtime:
        args.model_repository = repository_for(args.runtime, source=args.model_repository)
        print(f"runtime {args.runtime}: serving {args.model_repository}", flush=True)
    ports = Ports(args.http_port, args.grpc_port, args.metrics_port)
    env = {k: v for k, v in os.environ.items() if k != KEYS_ENV} if args.tritonserver else server_environment()
    print(f"tritonserver: HTTP {args.address}:{ports.http}  gRPC {ports.grpc}  metrics {ports.metrics}", flush=True)
    keys = ",".join(args.api_key + list(parse_keys(os.environ.get(KEYS_ENV))))
    start_api = None if args.no_openai else lambda: subprocess.Popen(openai_command(args), cwd=PROJECT_ROOT,
                                                                      env={**os.environ, KEYS_ENV: keys})
    if not args.no_supervise:
        return _supervise(args, ports, env, start_api)  # it keeps the OpenAI API running too
    api = start_api() if start_api else None
    try:
        command = server_command(args.model_repository, ports, address=args.address, extra_args=args.extra,
                                 binary=args.tritonserver)
        process = subprocess.Popen(command, env=env)
        _on_stop_signal(lambda: process.send_signal(signal.SIGTERM))
        return process.wait()
    finally:
        if api is not None:
            stop_openai(api)


def openai_command(args: argparse.Namespace) -> list[str]:
    """The OpenAI-compatible API beside the server: its gRPC port, and the supervisor's readiness when supervised."""
    local = _local_address(args.address)
    command = [sys.executable, "-m", "scripts.launcher.openai_server", "--triton-url", f"{local}:{args.grpc_port}",
               "--host", args.address, "--port", str(args.openai_port)]
    if not args.no_supervise:
        command += ["--health-url", f"http://{local}:{args.health_port}/health/ready"]
    return command


def stop_openai(process: subprocess.Popen, timeout_s: float = 10) -> None:
    """SIGTERM (uvicorn gives open streams a few seconds), then SIGKILL."""
    if process.poll() is None:
        terminate(process, timeout_s)


def _local_address(address: str) -> str:
    """Where this machine reaches a server bound to address."""
    return "127.0.0.1" if address in ("0.0.0.0", "::") else address


def _supervise(args, ports: Ports, env: dict[str, str], start_api) -> int:
    models = all_models(args.model_repository)
    command = server_command(args.model_repository, ports, address=args.address, explicit_models=models,
                             extra_args=args.extra, binary=args.tritonserver)
    local = _local_address(args.address)
    supervisor = Supervisor(lambda: subprocess.Popen(command, env=env), f"{local}:{ports.http}",
                            python_models(args.model_repository), start_api=start_api,
                            api_url=f"{local}:{args.openai_port}")
    stopped = threading.Event()
    _on_stop_signal(stopped.set)
    health = serve_health(supervisor, args.address, args.health_port)
    print(f"supervisor: readiness at http://{args.address}:{args.health_port}/health/ready", flush=True)
    failed = []

    def run():
        try:
            supervisor.start()
        except Exception as error:  # noqa: BLE001 - reported, and the command exits non-zero
            print(f"supervisor: tritonserver did not start: {error}", flush=True)
            failed.append(error)
            stopped.set()
            return
        supervisor.run()

    threading.Thread(target=run, name="supervisor", daemon=True).start()
    stopped.wait()
    code = supervisor.stop()
    health.shutdown()
    if failed:
        return 1
    return 0 if code in (0, None, -signal.SIGTERM) else code


def _on_stop_signal(callback) -> None:
    signal.signal(signal.SIGINT, lambda *_: callback())
    signal.signal(signal.SIGTERM, lambda *_: callback())


if __name__ == "__main__":
    sys.exit(main())
