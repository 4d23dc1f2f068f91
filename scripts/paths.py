"""The project's own paths, in one place: its root, the build folder, the model repository, the model folder."""

from __future__ import annotations

import os
from pathlib import Path

from python_backend.model_files import DEFAULT_MODEL_DIR, MODEL_DIR_ENV

PROJECT_ROOT = Path(__file__).resolve().parent.parent
BUILD_DIR = PROJECT_ROOT / "build"
MODEL_REPOSITORY = PROJECT_ROOT / "model_repository"
EXPORT_DIR = PROJECT_ROOT / DEFAULT_MODEL_DIR  # the fp32 export (`make model`); variants lie beside it


def default_model_dir() -> Path:
    """The exported model that commands use when none is named: ``$TRITON_LLM_MODEL_DIR``, else ``build/model``."""
    return Path(os.environ.get(MODEL_DIR_ENV) or EXPORT_DIR)
