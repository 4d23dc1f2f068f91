"""Reads (and writes) a Triton model's config.pbtxt with Triton's own protobuf schema (tritonclient's
model_config_pb2), so that scripts read the limits the server will use from the one source of truth."""

from __future__ import annotations

from pathlib import Path

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from scripts.paths import MODEL_REPOSITORY


def read_config(path: str | Path) -> model_config_pb2.ModelConfig:
    return text_format.Parse(Path(path).read_text(), model_config_pb2.ModelConfig())


def write_config(config: model_config_pb2.ModelConfig, path: str | Path, header: str = "") -> None:
    Path(path).write_text(header + text_format.MessageToString(config))


def llm_config(model_repository: str | Path = MODEL_REPOSITORY) -> model_config_pb2.ModelConfig:
    return read_config(Path(model_repository) / "llm" / "config.pbtxt")


def parameter(config: model_config_pb2.ModelConfig, key: str, default: str = "") -> str:
    return config.parameters[key].string_value if key in config.parameters else default
