"""Renders a copy of the model repository for another runtime, so that model_repository/ stays the one source of
truth: the llm model's runtime parameters are set, its instance_group becomes KIND_GPU for a GPU runtime, and
paths relative to the project (model_dir, trt_cache_dir, engine_path) become absolute, since the copy lives
elsewhere. Everything else is copied as it is (symlinks kept).

    python -m scripts.launcher.render_model_repository --runtime tensorrt --output build/model_repository-tensorrt
    make serve RUNTIME=tensorrt     # does this, then serves the copy
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from tritonclient.grpc import model_config_pb2

from python_backend.runtime.factory import GPU_RUNTIMES, RUNTIMES, RuntimeSettings
from scripts.launcher.model_config import read_config, write_config
from scripts.paths import MODEL_REPOSITORY, PROJECT_ROOT

PATH_PARAMETERS = ("model_dir", "trt_cache_dir", "engine_path")


def render(target: Path, runtime: str, source: Path = MODEL_REPOSITORY, project_root: Path = PROJECT_ROOT,
           io_binding: bool = False, precision: str | None = None, engine_path: str | None = None,
           gpu_instances: int = 1) -> Path:
    RuntimeSettings(runtime=runtime, io_binding=io_binding, precision=precision or "fp16")  # validates the choice
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(source, target, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
    for config_path in sorted(target.glob("*/config.pbtxt")):
        config = read_config(config_path)
        _absolute_paths(config, project_root)
        if config.name == "llm":
            _set_runtime(config, runtime, io_binding, precision, engine_path, gpu_instances)
        write_config(config, config_path, header=(
            f"# Rendered from {source / config_path.parent.name / 'config.pbtxt'} by scripts/launcher/render_model_repository.py "
            f"(runtime {runtime}): edit that file, not this one.\n"))
    return target


def repository_for(runtime: str, source: Path = MODEL_REPOSITORY) -> Path:
    """The repository to serve with this runtime: the source itself for the default one, else a rendered copy."""
    if runtime == RuntimeSettings().runtime:
        return source
    return render(PROJECT_ROOT / "build" / f"model_repository-{runtime}", runtime, source=source)


def _absolute_paths(config: model_config_pb2.ModelConfig, project_root: Path) -> None:
    for key in PATH_PARAMETERS:
        if key in config.parameters:
            value = config.parameters[key].string_value
            if value and not Path(value).is_absolute():
                config.parameters[key].string_value = str(project_root / value)


def _set_runtime(config, runtime: str, io_binding: bool, precision: str | None, engine_path: str | None,
                 gpu_instances: int) -> None:
    config.parameters["runtime"].string_value = runtime
    config.parameters["io_binding"].string_value = str(io_binding).lower()
    if precision:
        config.parameters["precision"].string_value = precision
    if engine_path:
        config.parameters["engine_path"].string_value = str(Path(engine_path).resolve())
    if runtime in GPU_RUNTIMES:
        del config.instance_group[:]
        config.instance_group.add(count=gpu_instances, kind=model_config_pb2.ModelInstanceGroup.KIND_GPU)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runtime", choices=RUNTIMES, required=True)
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--source", type=Path, default=MODEL_REPOSITORY)
    parser.add_argument("--io-binding", action="store_true", help="onnxruntime on the CPU: the device code path")
    parser.add_argument("--precision", choices=("fp16", "fp32"), help="onnxruntime-tensorrt's precision")
    parser.add_argument("--engine-path", help="tensorrt: the engine (default: <model_dir>/tensorrt/model.plan)")
    parser.add_argument("--gpu-instances", type=int, default=1, help="llm instances per GPU (KIND_GPU count)")
    args = parser.parse_args(argv)
    target = render(args.output, args.runtime, args.source, io_binding=args.io_binding, precision=args.precision,
                    engine_path=args.engine_path, gpu_instances=args.gpu_instances)
    print(target)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
