"""LoRA adapters from PEFT folders, and the fused graph's adapter inputs for the rows of a step.

A PEFT folder (``adapter_config.json`` + ``adapter_model.safetensors``) is read and checked against the base model's
projections before anything is kept: its targets must be projections these models have, its matrices their shapes.
Each adapter becomes, per layer and fused projection (``KINDS``), an ``A`` [in, width] and a ``B`` [width, out] with
PEFT's scaling folded into ``B`` (``lora_alpha / r``, or ``/ sqrt(r)`` with rsLoRA); q, k and v share the fused
graph's packed QKV projection, so their ``A`` sit side by side and their ``B`` in their own columns of the pack.

``AdapterInputs.for_rows`` gives the graph's inputs (scripts/prepare/lora_graph.py) for a step's rows, each row with
its adapter or none: the step's distinct adapters side by side (joined once per set of adapters, then reused), and one
mask per projection kind selecting each row's own columns.

Each variant on the fused graph holds an adapter graph (scripts/prepare/quantize.py); the slot cache
(python_backend/engine/kv_slots.py) keeps each row's adapter and feeds these inputs at every call; the llm model
keeps an AdapterStore (python_backend/serving/llm_adapters.py).
"""

from __future__ import annotations

import json
import math
import re
import secrets
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

# The fused graph's projections and the model modules (PEFT's target names) each one packs, in column order.
KINDS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",), "gate_proj": ("gate_proj",),
         "up_proj": ("up_proj",), "down_proj": ("down_proj",)}
KIND_OF = {module: kind for kind, modules in KINDS.items() for module in modules}
_TENSOR = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
_A_INPUT = re.compile(r"^lora\.(\d+)\.(\w+)\.a$")
UNSUPPORTED = {"use_dora": "DoRA", "modules_to_save": "modules_to_save (whole modules trained beside the adapter)",
               "rank_pattern": "rank_pattern (a rank per module)",
               "alpha_pattern": "alpha_pattern (an alpha per module)"}


def a_input(layer: int, kind: str) -> str:
    return f"lora.{layer}.{kind}.a"


def b_input(layer: int, kind: str) -> str:
    return f"lora.{layer}.{kind}.b"


def mask_input(kind: str) -> str:
    return f"lora_mask.{kind}"


class AdapterError(ValueError):
    """A PEFT folder that does not fit the base model, said before anything of it is kept."""


@dataclass(frozen=True)
class BaseShapes:
    """The base model's projections: each module's (in, out) features and the number of layers."""

    num_layers: int
    modules: dict[str, tuple[int, int]]  # q_proj -> (hidden, heads x head_dim), ...

    @classmethod
    def from_config(cls, config: dict) -> "BaseShapes":
        hidden, heads = config["hidden_size"], config["num_attention_heads"]
        head_dim = config.get("head_dim") or hidden // heads
        kv = config.get("num_key_value_heads", heads) * head_dim
        inner = config["intermediate_size"]
        return cls(config["num_hidden_layers"], {
            "q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
            "o_proj": (heads * head_dim, hidden), "gate_proj": (hidden, inner), "up_proj": (hidden, inner),
            "down_proj": (inner, hidden)})

    def to_json(self) -> dict:
        return {"num_layers": self.num_layers, "modules": {m: list(shape) for m, shape in self.modules.items()}}

    @classmethod
    def from_json(cls, raw: dict) -> "BaseShapes":
        """What to_json wrote (a variant's llm_settings.json ``lora_base``: scripts/prepare/quantize.py)."""
        return cls(int(raw["num_layers"]), {m: (int(i), int(o)) for m, (i, o) in raw["modules"].items()})

    def kind_shape(self, kind: str) -> tuple[int, int]:
        """(in, out) of a fused projection: the packed QKV's out is q's, k's and v's together."""
        modules = KINDS[kind]
        return self.modules[modules[0]][0], sum(self.modules[m][1] for m in modules)

    def columns(self, module: str) -> slice:
        """The module's columns within its fused projection."""
        kind = KIND_OF[module]
        start = 0
        for other in KINDS[kind]:
            if other == module:
                return slice(start, start + self.modules[module][1])
            start += self.modules[other][1]
        raise KeyError(module)


@dataclass
class Adapter:
    """One adapter's matrices per (layer, fused projection kind), scaling folded into B; ``widths`` per kind is the
    same in every layer (a layer the adapter leaves out holds zeros there)."""

    name: str
    widths: dict[str, int]
    matrices: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]] = field(repr=False)
    # This load of the adapter (a name loaded again with other weights is another adapter to the prefix cache).
    key: str = field(default_factory=lambda: secrets.token_hex(8))

    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.matrices.values())


def read_peft(folder: str | Path, name: str, base: BaseShapes, max_rank: int = 64) -> Adapter:
    """The adapter in a PEFT folder, checked against the base model first; AdapterError names what does not fit."""
    from safetensors.numpy import load_file

    folder = Path(folder)
    config_path, weights_path = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    for path in (config_path, weights_path):
        if not path.is_file():
            raise AdapterError(f"adapter {name!r}: {folder} has no {path.name} (a PEFT LoRA folder has "
                               "adapter_config.json and adapter_model.safetensors)")
    config = json.loads(config_path.read_text())
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"adapter {name!r}: peft_type {config.get('peft_type')!r}, not LORA")
    for key, what in UNSUPPORTED.items():
        if config.get(key):
            raise AdapterError(f"adapter {name!r}: {what} is not supported")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"adapter {name!r}: bias {config['bias']!r} is not supported (only 'none')")
    if config.get("fan_in_fan_out"):
        raise AdapterError(f"adapter {name!r}: fan_in_fan_out (Conv1D layers) does not fit these Linear layers")
    rank = int(config["r"])
    if not 0 < rank <= max_rank:
        raise AdapterError(f"adapter {name!r}: rank {rank} is beyond max_lora_rank {max_rank}")
    scaling = config["lora_alpha"] / (math.sqrt(rank) if config.get("use_rslora") else rank)

    pairs: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for key, tensor in load_file(str(weights_path)).items():
        match = _TENSOR.match(key)
        if match is None or match.group(2) not in KIND_OF:
            raise AdapterError(f"adapter {name!r}: {key} is not a LoRA matrix of a projection this model has "
                               f"({', '.join(KIND_OF)})")
        layer, module = int(match.group(1)), match.group(2)
        if layer >= base.num_layers:
            raise AdapterError(f"adapter {name!r}: {key} names layer {layer}; the base model has {base.num_layers}")
        pairs.setdefault((layer, module), {})[match.group(3)] = tensor
    if not pairs:
        raise AdapterError(f"adapter {name!r}: {weights_path} holds no LoRA matrices")
    for (layer, module), pair in pairs.items():
        features_in, features_out = base.modules[module]
        want = {"A": (rank, features_in), "B": (features_out, rank)}
        for part, shape in want.items():
            got = pair.get(part)
            if got is None or tuple(got.shape) != shape:
                raise AdapterError(
                    f"adapter {name!r}: layer {layer} {module}.lora_{part} is "
                    f"{'missing' if got is None else list(got.shape)}; this base model needs {list(shape)}")

    modules = sorted({module for _, module in pairs}, key=list(KIND_OF).index)
    widths = {kind: rank * sum(m in modules for m in KINDS[kind]) for kind in KINDS}
    widths = {kind: w for kind, w in widths.items() if w}
    matrices = {}
    for layer in range(base.num_layers):
        for kind, kind_width in widths.items():
            features_in, features_out = base.kind_shape(kind)
            a = np.zeros((features_in, kind_width), np.float32)
            b = np.zeros((kind_width, features_out), np.float32)
            offset = 0
            for module in (m for m in KINDS[kind] if m in modules):
                pair = pairs.get((layer, module))
                if pair is not None:
                    a[:, offset:offset + rank] = pair["A"].astype(np.float32).T
                    b[offset:offset + rank, base.columns(module)] = pair["B"].astype(np.float32).T * scaling
                offset += rank
            matrices[(layer, kind)] = (a, b)
    return Adapter(name, widths, matrices)


def adapter_bytes(base: BaseShapes, rank: int) -> int:
    """The most bytes one adapter of this rank holds as read (every projection of every layer; fp32 A and B)."""
    total = 0
    for kind, modules in KINDS.items():
        features_in, features_out = base.kind_shape(kind)
        total += rank * len(modules) * (features_in + features_out) * np.dtype(np.float32).itemsize
    return total * base.num_layers


def graph_targets(inputs) -> dict[tuple[int, str], tuple[int, int]]:
    """(layer, kind) -> (in, out) of a graph's adapter inputs, from its inputs' (name, shape): A is [in, width] and B
    [width, out] (python_backend/runtime/onnx_slot_decoder.py reads them from its session)."""
    shapes = dict(inputs)
    found = {}
    for name, shape in shapes.items():
        match = _A_INPUT.match(name)
        if match:
            layer, kind = int(match.group(1)), match.group(2)
            found[(layer, kind)] = (int(shape[0]), int(shapes[b_input(layer, kind)][1]))
    return found


class AdapterInputs:
    """The adapter inputs of the fused graph's projections (``targets``: (layer, kind) -> (in, out)) for the rows of
    a step. The last set of adapters' joined matrices is kept: consecutive steps mostly run the same set."""

    def __init__(self, targets: dict[tuple[int, str], tuple[int, int]]):
        self.targets = targets
        self.kinds = sorted({kind for _, kind in targets})
        self._joined: tuple[tuple[str, ...], dict[str, np.ndarray]] | None = None
        self._rows: tuple[tuple, dict[str, np.ndarray]] | None = None

    def for_rows(self, adapters: list[Adapter | None]) -> dict[str, np.ndarray]:
        """The same arrays as the last call's for the same rows' adapters (the decoder binds an array once)."""
        rows = tuple(a and a.key for a in adapters)
        if self._rows is not None and self._rows[0] == rows:
            return self._rows[1]
        active = list({a.key: a for a in adapters if a is not None}.values())
        key = tuple(a.key for a in active)
        if self._joined is None or self._joined[0] != key:
            self._joined = (key, self._join(active))
        inputs = dict(self._joined[1])
        for kind in self.kinds:
            starts, start = {}, 0
            for adapter in active:
                starts[adapter.key] = start
                start += adapter.widths.get(kind, 0)
            mask = np.zeros((len(adapters), 1, start), np.float32)
            for row, adapter in enumerate(adapters):
                if adapter is not None and adapter.widths.get(kind):
                    mask[row, 0, starts[adapter.key]:starts[adapter.key] + adapter.widths[kind]] = 1.0
            inputs[mask_input(kind)] = mask
        self._rows = (rows, inputs)
        return inputs

    def _join(self, active: list[Adapter]) -> dict[str, np.ndarray]:
        joined = {}
        for (layer, kind), (features_in, features_out) in self.targets.items():
            parts = [a.matrices[(layer, kind)] for a in active if kind in a.widths]
            if len(parts) == 1:  # one adapter: its own matrices, no copy
                joined[a_input(layer, kind)], joined[b_input(layer, kind)] = parts[0]
                continue
            joined[a_input(layer, kind)] = np.ascontiguousarray(
                np.concatenate([a for a, _ in parts], axis=1) if parts else np.zeros((features_in, 0), np.float32))
            joined[b_input(layer, kind)] = np.ascontiguousarray(
                np.concatenate([b for _, b in parts], axis=0) if parts else np.zeros((0, features_out), np.float32))
        return joined


MAX_NAME_CHARS = 128


class AdapterStore:
    """The adapters a server knows, by name (each a PEFT folder), and those resident in memory: at most
    ``max_loras``, the least recently used dropped beyond that and read again from its folder when next asked for.
    A sequence holds its Adapter, so dropping or unloading one never changes a request that runs with it.
    Thread-safe: requests ask for adapters while a load or unload registers them."""

    def __init__(self, base: BaseShapes, max_loras: int, max_rank: int = 64):
        if max_loras < 1:
            raise ValueError(f"max_loras must be at least 1 to serve adapters, got {max_loras}")
        self.base, self.max_loras, self.max_rank = base, max_loras, max_rank
        self._folders: dict[str, tuple[Path, str]] = {}  # name -> (folder, the registration's key)
        self._resident: OrderedDict[str, Adapter] = OrderedDict()
        self._lock = threading.Lock()

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._folders)

    def load(self, name: str, folder: str | Path) -> Adapter:
        """Registers the folder under this name, read and checked first (AdapterError says what does not fit). The
        same name and folder again is a no-op; another folder under a loaded name is refused."""
        if not name or len(name) > MAX_NAME_CHARS or any(c in name for c in ",=\n"):
            raise AdapterError(f"adapter name {name!r}: 1 to {MAX_NAME_CHARS} characters, none of , = or newline")
        folder = Path(folder).resolve()
        with self._lock:
            known = self._folders.get(name)
            if known is not None:
                if known[0] != folder:
                    raise AdapterError(f"adapter {name!r} is already loaded from {known[0]}: unload it first")
                return self._get_locked(name)
        adapter = read_peft(folder, name, self.base, self.max_rank)  # outside the lock: requests go on meanwhile
        with self._lock:
            known = self._folders.setdefault(name, (folder, adapter.key))
            if known[0] != folder:  # another load of this name came first
                raise AdapterError(f"adapter {name!r} is already loaded from {known[0]}: unload it first")
            adapter.key = known[1]
            self._resident[name] = adapter
            self._trim_locked()
        return adapter

    def unload(self, name: str) -> None:
        with self._lock:
            if self._folders.pop(name, None) is None:
                raise UnknownAdapterError(f"adapter {name!r} is not loaded")
            self._resident.pop(name, None)

    def get(self, name: str) -> Adapter:
        """The adapter by name, read again from its folder if it was dropped; UnknownAdapterError when no adapter
        of that name is loaded."""
        with self._lock:
            return self._get_locked(name)

    def _get_locked(self, name: str) -> Adapter:
        adapter = self._resident.get(name)
        if adapter is not None:
            self._resident.move_to_end(name)
            return adapter
        known = self._folders.get(name)
        if known is None:
            loaded = ", ".join(sorted(self._folders)) or "none"
            raise UnknownAdapterError(f"LoRA adapter {name!r} is not loaded (loaded: {loaded})")
        adapter = read_peft(known[0], name, self.base, self.max_rank)
        adapter.key = known[1]  # the same registration: its cached prefixes are still its own
        self._resident[name] = adapter
        self._trim_locked()
        return adapter

    def _trim_locked(self) -> None:
        while len(self._resident) > self.max_loras:
            self._resident.popitem(last=False)

    def resident_bytes(self) -> int:
        with self._lock:
            return sum(a.nbytes() for a in self._resident.values())


class UnknownAdapterError(AdapterError):
    """A request or an unload names an adapter that is not loaded (the OpenAI API answers 404)."""


def parse_modules(text: str) -> dict[str, str]:
    """``name=path[,name=path...]`` (vLLM's --lora-modules form, make serve's LORA_MODULES) as name -> path."""
    modules = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, path = item.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise AdapterError(f"LoRA module {item!r}: expected name=path")
        modules[name.strip()] = path.strip()
    return modules
