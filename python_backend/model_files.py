"""Where an exported model lives, and the generation settings the export writes beside it.

An exported model folder holds ``onnx/model.onnx`` (+ external data), the tokenizer files, ``llm_settings.json``
(EOS ids, context length, quantization variant) and ``parity_report.json``. A quantized variant
(scripts/prepare/quantize.py) is a folder of the same shape."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

ONNX_FILE = "onnx/model.onnx"
ADAPTER_ONNX_FILE = "onnx/model.lora.onnx"  # a variant's graph with adapter inputs (scripts/prepare/lora_graph.py)
SETTINGS_FILE = "llm_settings.json"
PARITY_REPORT_FILE = "parity_report.json"
MODEL_DIR_ENV = "TRITON_LLM_MODEL_DIR"
# Where `make model` exports, relative to the project root; the model configs' `model_dir` parameters say the same.
DEFAULT_MODEL_DIR = "build/model"


@dataclass(frozen=True)
class ModelSettings:
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    pad_token_id: int | None
    max_position_embeddings: int
    model_name: str
    quantization: str = "fp32"  # the variant (scripts/prepare/quantize.py): fp32, int4, fast or fp16

    @classmethod
    def load(cls, model_dir: str | os.PathLike) -> "ModelSettings":
        raw = json.loads((Path(model_dir) / SETTINGS_FILE).read_text())
        return cls(
            eos_token_ids=tuple(raw["eos_token_ids"]),
            bos_token_id=raw.get("bos_token_id"),
            pad_token_id=raw.get("pad_token_id"),
            max_position_embeddings=int(raw["max_position_embeddings"]),
            model_name=raw.get("model_name", "unknown"),
            quantization=raw.get("quantization", "fp32"),
        )


def resolve_model_dir(configured: str, model_repository: str | os.PathLike) -> Path:
    """The exported model folder: ``$TRITON_LLM_MODEL_DIR`` if set, else the model config's ``model_dir``
    parameter, which may be relative to the folder that holds the model repository."""
    chosen = os.environ.get(MODEL_DIR_ENV) or configured
    path = Path(chosen)
    if not path.is_absolute():
        # model_repository is the model's own folder, e.g. <project>/model_repository/llm
        path = Path(model_repository).resolve().parent.parent / path
    if not (path / SETTINGS_FILE).is_file():
        raise FileNotFoundError(
            f"no exported model at {path} (missing {SETTINGS_FILE}); run `make model` or set {MODEL_DIR_ENV}"
        )
    return path
