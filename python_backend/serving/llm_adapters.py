"""LoRA adapters in the llm model: its settings, the adapters named at start, and the requests that name, load or
unload one.

On when ``max_loras`` is above 0 or adapters are named (``lora_modules``, or ``$TRITON_LLM_LORA_MODULES`` that
``make serve LORA_MODULES=...`` sets): the llm model then runs its variant's adapter graph
(scripts/prepare/lora_graph.py) and keeps an AdapterStore (python_backend/lora.py). A request names its adapter in
``lora_name``; a request with ``lora_name`` and ``lora_path`` and no prompt loads that PEFT folder under that name,
one with ``lora_unload: true`` unloads it (the OpenAI API's /v1/load_lora_adapter and /v1/unload_lora_adapter send
these).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from python_backend.errors import InvalidRequestError
from python_backend.lora import AdapterError, AdapterStore, BaseShapes, adapter_bytes, parse_modules
from python_backend.model_files import SETTINGS_FILE
from python_backend.serving.request_inputs import TensorGetter, scalar

LORA_MODULES_ENV = "TRITON_LLM_LORA_MODULES"
DEFAULT_MAX_LORAS = 4  # when adapters are named and max_loras is not set


@dataclass(frozen=True)
class LoraSettings:
    max_loras: int = 0
    max_rank: int = 64
    modules: dict[str, str] = field(default_factory=dict)

    @property
    def enabled(self) -> bool:
        return self.max_loras > 0

    def reserved_bytes(self, base: BaseShapes) -> int:
        """What adapters may hold, taken from the KV budget: max_loras resident at max_lora_rank, and as much again
        for a step's adapters joined side by side (a step runs at most max_loras of them: the scheduler's bound)."""
        return 2 * self.max_loras * adapter_bytes(base, self.max_rank) if self.enabled else 0

    @classmethod
    def from_parameters(cls, params: dict[str, str], environ=os.environ) -> "LoraSettings":
        try:
            modules = {**parse_modules(params.get("lora_modules", "")),
                       **parse_modules(environ.get(LORA_MODULES_ENV, ""))}
        except AdapterError as error:
            raise ValueError(f"lora_modules: {error}") from None
        max_loras = int(params.get("max_loras") or 0)
        if modules and max_loras == 0:
            max_loras = max(DEFAULT_MAX_LORAS, len(modules))
        return cls(max_loras, int(params.get("max_lora_rank") or 64), modules)


def open_store(settings: LoraSettings, model_dir: Path, project_root: Path) -> AdapterStore | None:
    """The adapter store with the named adapters loaded (a folder that does not fit fails the model's load, naming
    it), or None when LoRA is off."""
    if not settings.enabled:
        return None
    raw = json.loads((model_dir / SETTINGS_FILE).read_text())
    if "lora_base" not in raw:
        raise ValueError(f"LoRA adapters need a variant's folder on the fused graph with its adapter graph "
                         f"(`make variants` builds them); {model_dir} has none")
    store = AdapterStore(BaseShapes.from_json(raw["lora_base"]), settings.max_loras, settings.max_rank)
    for name, path in settings.modules.items():
        folder = Path(path) if Path(path).is_absolute() else project_root / path
        store.load(name, folder)
    return store


@dataclass(frozen=True)
class AdapterRequest:
    """What a request asks of the adapters: a name to run with, or a load or unload."""

    name: str | None
    load_path: str | None = None
    unload: bool = False

    @property
    def is_control(self) -> bool:
        return self.load_path is not None or self.unload


def adapter_request(get: TensorGetter) -> AdapterRequest:
    name = scalar(get, "lora_name")
    load_path, unload = scalar(get, "lora_path"), bool(scalar(get, "lora_unload", False))
    if (load_path is not None or unload) and not name:
        raise InvalidRequestError("lora_path and lora_unload need a lora_name")
    if load_path is not None and unload:
        raise InvalidRequestError("a request either loads (lora_path) or unloads (lora_unload) an adapter")
    return AdapterRequest(name or None, load_path, unload)


def apply_control(request: AdapterRequest, store: AdapterStore | None, project_root: Path) -> None:
    """Loads or unloads an adapter (a relative folder is the project root's, as at start); refusals are
    InvalidRequestErrors naming what is wrong."""
    try:
        if store is None:
            raise AdapterError("this server serves no LoRA adapters: start it with max_loras above 0 or "
                               "LORA_MODULES")
        if request.unload:
            store.unload(request.name)
        else:
            folder = Path(request.load_path)
            store.load(request.name, folder if folder.is_absolute() else project_root / folder)
    except AdapterError as error:
        raise InvalidRequestError(str(error)) from None


def adapter_for(request: AdapterRequest, store: AdapterStore | None):
    """The Adapter a generation request runs with (None: the base model)."""
    if request.name is None:
        return None
    try:
        if store is None:
            raise AdapterError(f"LoRA adapter {request.name!r}: this server serves no adapters (start it with "
                               "max_loras above 0 or LORA_MODULES)")
        return store.get(request.name)
    except AdapterError as error:
        raise InvalidRequestError(str(error)) from None
