"""The device code paths on a real GPU (``pytest -m gpu``; scripts/gpu_check.sh runs these on a GPU machine).

Each test needs only what it names and skips, saying what is missing, elsewhere: the KV batch's device tensors need
torch with CUDA; the whole engine with its cache on the GPU also needs the export and onnxruntime (any build: the
forward pass runs on the CPU and only the cache lives on the GPU); the onnxruntime CUDA and TensorRT runtimes need
onnxruntime-gpu. Each compares with the CPU path, which `make test` checks token-exactly against PyTorch.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from python_backend.engine.kv_batch import KVBatch
from python_backend.model_files import MODEL_DIR_ENV, ONNX_FILE
from python_backend.runtime.decoder import ServingLimits, TorchTensors
from scripts.paths import PROJECT_ROOT
from tests.helpers import generate_staggered

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch", reason="the device paths keep the KV cache in torch tensors")
if not torch.cuda.is_available():
    pytest.skip(f"no CUDA device visible to torch {torch.__version__} (CUDA build: {torch.version.cuda or 'none'})",
                allow_module_level=True)

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "用一句话介绍一下长城。",
           "List three colors.", "def add(a, b):", "Count from one to ten."]


def export_dir() -> Path:
    path = Path(os.environ.get(MODEL_DIR_ENV, PROJECT_ROOT / "build" / "model"))
    if not (path / ONNX_FILE).is_file():
        pytest.skip(f"no exported model at {path} (make model, or set {MODEL_DIR_ENV})")
    return path


def test_kv_batch_rows_dropped_and_joined_on_the_gpu_equal_the_cpu():
    """select() and extend() (the only copies of the cache, made when a batch's membership changes) on CUDA tensors
    give exactly what they give on CPU tensors, and leave every tensor on the device."""
    batches = {}
    for device in ("cpu", "cuda"):
        tensors = TorchTensors(device)
        made = []
        for rows, length in ((3, 7), (2, 11)):
            past = [torch.randn((rows, 3, length, 64), generator=torch.Generator().manual_seed(length + i))
                    .to(tensors.device) for i in range(4)]
            mask = np.ones((rows, length), np.int64)
            mask[0, :2] = 0
            made.append(KVBatch(past, mask, mask.sum(axis=1), tensors))
        first, second = made
        first.extend(second)
        first.select([4, 1, 0])
        batches[device] = first
    cpu, gpu = batches["cpu"], batches["cuda"]
    assert all(t.device.type == "cuda" and t.is_contiguous() for t in gpu.past)
    np.testing.assert_array_equal(cpu.attention_mask, gpu.attention_mask)
    np.testing.assert_array_equal(cpu.next_positions, gpu.next_positions)
    assert gpu.cache_bytes() == cpu.cache_bytes()
    for a, b in zip(cpu.past, gpu.past):
        assert torch.equal(a, b.cpu())


class CacheOnGpu:
    """The CPU decoder's forward pass with the cache kept on the GPU between steps: the engine, the KV batch and
    their copies run on CUDA tensors while onnxruntime (a CPU build here) computes. Test-only: the real GPU runtimes
    never move the cache."""

    def __init__(self, decoder):
        self.decoder, self.cache_shape, self.vocab_size = decoder, decoder.cache_shape, decoder.vocab_size
        self.tensors = TorchTensors("cuda")

    def empty_cache(self, batch_size):
        return [t.to(self.tensors.device) for t in self.decoder.empty_cache(batch_size)]

    def forward(self, input_ids, attention_mask, position_ids, past):
        assert all(t.device.type == "cuda" for t in past)
        logits, present = self.decoder.forward(input_ids, attention_mask, position_ids,
                                               [t.cpu().contiguous() for t in past])
        return logits, [t.to(self.tensors.device) for t in present]


@pytest.fixture(scope="module")
def cpu_answers():
    pytest.importorskip("onnxruntime", reason="the forward pass runs on onnxruntime")
    from python_backend.runtime.onnx_decoder import OnnxDecoder
    from python_backend.serving.tokenization import PromptTokenizer

    model_dir = export_dir()
    prompt_ids = [PromptTokenizer(model_dir).encode(p, apply_chat_template=True) for p in PROMPTS]
    return model_dir, prompt_ids, generate_staggered(OnnxDecoder(model_dir / ONNX_FILE), prompt_ids)


def test_the_engine_with_its_cache_on_the_gpu_is_token_exact(cpu_answers):
    from python_backend.runtime.onnx_device_decoder import OnnxDeviceDecoder

    model_dir, prompt_ids, expected = cpu_answers
    assert generate_staggered(CacheOnGpu(OnnxDeviceDecoder.on_cpu(model_dir / ONNX_FILE)), prompt_ids) == expected


def _gpu_runtime(runtime: str, provider: str, model_dir: Path, **settings):
    import onnxruntime as ort

    from python_backend.runtime.factory import RuntimeSettings, open_decoder

    if provider not in ort.get_available_providers():
        pytest.skip(f"this onnxruntime has no {provider} (onnxruntime-gpu has it)")
    limits = ServingLimits(max_batch_size=8, max_prefill_tokens=256, max_context_length=512)
    return open_decoder(RuntimeSettings(runtime=runtime, **settings), model_dir, limits, PROJECT_ROOT)


def test_the_onnxruntime_cuda_runtime_matches_the_cpu(cpu_answers):
    model_dir, prompt_ids, expected = cpu_answers
    decoder = _gpu_runtime("onnxruntime-cuda", "CUDAExecutionProvider", model_dir)
    answers = generate_staggered(decoder, prompt_ids)
    # fp32 on another device's kernels: a near-tie may flip late; most answers must be identical.
    assert sum(a == e for a, e in zip(answers, expected)) >= len(expected) - 1, (answers, expected)


def test_the_onnxruntime_cuda_runtime_runs_a_variants_fused_graph_on_its_slot_cache(cpu_answers):
    """A QUANT variant's folder (fp32 on the fused graph) on onnxruntime-cuda: GroupQueryAttention writing the slots
    in CUDA tensors in place (OnnxSlotDeviceDecoder), against the CPU's fused graph."""
    from python_backend.model_files import PARITY_REPORT_FILE
    from python_backend.runtime.onnx_slot_decoder import OnnxSlotDecoder

    model_dir, prompt_ids, _ = cpu_answers
    fused = model_dir.with_name(f"{model_dir.name}-fp32")
    if not (fused / PARITY_REPORT_FILE).is_file():
        pytest.skip(f"no fp32 variant at {fused} (make model QUANT=fp32)")
    expected = generate_staggered(OnnxSlotDecoder(fused / ONNX_FILE), prompt_ids)
    decoder = _gpu_runtime("onnxruntime-cuda", "CUDAExecutionProvider", fused)
    assert type(decoder).__name__ == "OnnxSlotDeviceDecoder"
    answers = generate_staggered(decoder, prompt_ids)
    assert sum(a == e for a, e in zip(answers, expected)) >= len(expected) - 1, (answers, expected)


def test_the_onnxruntime_tensorrt_runtime_agrees_on_the_first_tokens(cpu_answers, tmp_path):
    model_dir, prompt_ids, expected = cpu_answers
    decoder = _gpu_runtime("onnxruntime-tensorrt", "TensorrtExecutionProvider", model_dir,
                           trt_cache_dir=str(tmp_path))
    answers = generate_staggered(decoder, prompt_ids)
    # FP16: the first tokens agree; later ones may drift, as the quantized variants' reports show for int8.
    assert sum(a[:4] == e[:4] for a, e in zip(answers, expected)) >= len(expected) - 1, (answers, expected)
