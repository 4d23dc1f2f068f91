#!/usr/bin/env bash
# The GPU checks, in one run of a few minutes on a machine with an NVIDIA GPU:
#   bash scripts/gpu_check.sh            (PYTHON=/path/to/python to choose the interpreter)
# What they need: torch with CUDA, numpy and pytest. With the export (build/model or $TRITON_LLM_MODEL_DIR) and
# onnxruntime, the whole engine runs with its KV cache on the GPU; with onnxruntime-gpu, the onnxruntime CUDA and
# TensorRT runtimes; with tensorrt, the engine build and the tensorrt runtime. Each test that lacks something
# skips and says what; the summary at the end lists them.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=$(command -v python3); fi
fi

echo "== machine"
nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv,noheader 2>/dev/null \
    || echo "nvidia-smi: not found or no GPU"
"$PYTHON" - <<'PY'
import importlib, platform
print(f"python {platform.python_version()}")
for name in ("numpy", "torch", "onnxruntime", "tensorrt", "pytest"):
    try:
        module = importlib.import_module(name)
    except Exception as error:  # noqa: BLE001 - report, do not fail
        print(f"{name}: not importable ({type(error).__name__})")
        continue
    extra = ""
    if name == "torch":
        extra = f", CUDA {module.version.cuda}, devices: {module.cuda.device_count()}"
        if module.cuda.is_available():
            extra += f" ({module.cuda.get_device_name(0)}, capability {module.cuda.get_device_capability(0)})"
    if name == "onnxruntime":
        extra = f", providers: {', '.join(module.get_available_providers())}"
    print(f"{name} {getattr(module, '__version__', '?')}{extra}")
PY
MODEL_DIR=${TRITON_LLM_MODEL_DIR:-build/model}
if [ -f "$MODEL_DIR/onnx/model.onnx" ]; then echo "export: $MODEL_DIR"; else echo "export: none at $MODEL_DIR"; fi

echo "== gpu tests"
export TRITON_LLM_MODEL_DIR=$(realpath -m "$MODEL_DIR") HF_HUB_OFFLINE=1
PYTHONPATH=. timeout 540 "$PYTHON" -m pytest -p no:cacheprovider -m gpu -v -rs \
    tests/test_gpu_paths.py tests/test_build_engine.py
status=$?
echo "== done: pytest exit status $status (0: no failures; the skips above say what was missing)"
exit $status
