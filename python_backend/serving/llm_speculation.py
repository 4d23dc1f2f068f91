"""Speculative decoding in the llm model: its settings and its draft model (python_backend/engine/speculative.py).

``speculative_draft`` names the draft: a variant (its folder beside the served one: ``fast`` for build/model-fp32
is build/model-fast) or a folder (relative to the project root), for every served variant, or per served variant as
``served=draft,...`` (``fp32=fast,fp16=fast``: the others decode plainly); empty: off. It is off, with a line saying
why, where it cannot help or run: the served folder is the draft itself, the draft is not built, or the served graph
is the export's own (the GPU runtimes' padded cache).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from python_backend.engine.speculative import DEFAULT_DRAFT_TOKENS
from python_backend.model_files import ONNX_FILE, SETTINGS_FILE, ModelSettings


@dataclass(frozen=True)
class SpeculationSettings:
    draft: str = ""
    draft_tokens: int = DEFAULT_DRAFT_TOKENS

    @classmethod
    def from_parameters(cls, params: dict[str, str]) -> "SpeculationSettings":
        tokens = int(params.get("speculative_tokens") or DEFAULT_DRAFT_TOKENS)
        if tokens < 1:
            raise ValueError(f"speculative_tokens must be at least 1, not {tokens}")
        draft = params.get("speculative_draft", "").strip()
        if "=" in draft and any(pair.count("=") != 1 for pair in draft.split(",")):
            raise ValueError(f"speculative_draft {draft!r}: one draft for every variant (fast), or served=draft "
                             "pairs (fp32=fast,fp16=fast)")
        return cls(draft, tokens)

    def draft_for(self, served: str) -> str:
        """The draft named for this served variant ("" for none)."""
        if "=" not in self.draft:
            return self.draft
        pairs = {k.strip(): v.strip() for k, v in (pair.split("=") for pair in self.draft.split(","))}
        return pairs.get(served, "")

    def draft_dir(self, model_dir: Path, settings: ModelSettings, project_root: Path) -> Path | None:
        """The draft model's folder, or None (with the reason printed) when speculative decoding is off."""
        draft = self.draft_for(settings.quantization)
        if not draft:
            if self.draft:
                print(f"[llm] speculative decoding off: speculative_draft {self.draft!r} names no draft for "
                      f"{settings.quantization}", file=sys.stderr, flush=True)
            return None
        model_dir = model_dir.resolve()  # a link to the served folder (docker/compose.yaml's /models/serve) names it
        if "/" in draft:
            folder = Path(draft) if Path(draft).is_absolute() else project_root / draft
        else:
            suffix = f"-{settings.quantization}"
            base = model_dir.name[:-len(suffix)] if model_dir.name.endswith(suffix) else model_dir.name
            folder = model_dir.with_name(f"{base}-{draft}")
        reason = self._unusable(folder.resolve(), model_dir, draft)
        if reason:
            print(f"[llm] speculative decoding off: {reason}", file=sys.stderr, flush=True)
            return None
        return folder

    @staticmethod
    def _unusable(folder: Path, model_dir: Path, draft: str) -> str | None:
        from python_backend.runtime.onnx_slot_decoder import is_fused_graph

        if folder == model_dir:
            return f"the served folder is the draft model itself ({folder})"
        if not (folder / SETTINGS_FILE).is_file():
            return f"no draft model at {folder} (`make model QUANT={draft}` builds a variant)"
        if not is_fused_graph(model_dir / ONNX_FILE):
            return f"{model_dir} is the export's own graph (a padded KV cache): a variant's folder has the slot cache"
        return None
