"""The engine tests' tiny model: its recipe and its build (`make tiny-model`, which `make test` runs first, or the
`tiny_dir` fixture of tests/conftest.py where it is missing or out of date).

The engine's own logic (scheduling, batching, the slot cache, prefix caching, speculative decoding, the device path)
is tested on a tiny random Llama rather than the real model: the properties those tests check (a batch gives each row
its answer alone, reuse on and off give the same bits, ...) are the engine's whatever the weights, and the tiny
model computes a step about 30 times faster. It keeps what those tests lean on: SmolLM2's tokenizer and chat template
(the same prompt ids), 3 KV heads of 64 (the slot cache's pages then hold 16 tokens, as the real model's do, and a
whole prompt's logits cost 64 tokens of the budget), and weights spread wide enough (0.2) that every answer of the
tests' prompts is 24 different tokens that depend on the whole prompt: at 0.05-0.1 they fell into loops of one to
three tokens, which would hide a row reading another row's cache. The real model's own answers are checked against
transformers elsewhere (test_server, test_prompt_scores, the server tests)."""

from __future__ import annotations

import fcntl
import hashlib
import json
import shutil
import sys
from pathlib import Path

from python_backend.model_files import PARITY_REPORT_FILE
from scripts.paths import BUILD_DIR, EXPORT_DIR
from scripts.prepare.build_marks import EXPORT_MARK, VARIANT_MARK, source_fingerprint, up_to_date
from scripts.prepare.export_onnx import export_source
from scripts.prepare.quantize import RECIPES, fingerprint, variant_dir
from tests.helpers import export_tiny

RECIPE = {"hidden_size": 96, "intermediate_size": 192, "num_hidden_layers": 2, "num_attention_heads": 6,
          "num_key_value_heads": 3, "head_dim": 64, "initializer_range": 0.2, "seed": 0}
VERSION = 1  # bump when _source writes the folder differently
# The export's parity bound for this model. Its own tests compare the engine with itself; this check is there to catch
# a broken export (off by 0.1 or more). CI's machine measured 3.7e-3 on it (2026-12-05) where every CPU path tried here
# gives 1.5e-5 to 3e-5 (onnxruntime under qemu as Haswell, EPYC and Nehalem; PyTorch with MKL and oneDNN capped at
# AVX2 or SSE4): the default 1e-3 is set for trained models.
LOGIT_TOLERANCE = 1e-2
VARIANTS = ("fp32", "fast")
ROOT = BUILD_DIR / "tiny"
RECIPE_FILE = "tiny_recipe.json"


def tiny_engine_model(model_dir: Path, root: Path = ROOT, source: Path | None = None) -> Path:
    """The export of the tiny model in root/model (VARIANTS beside it), built where it is missing or out of date:
    its recipe, the model whose tokenizer and config it takes (model_dir's source, the file or folder its export was
    made from: read from the source, not the export, so that it is built beside the export, not after it), the
    export's format and the variants' (the marks `make model` and `make variants` keep), all read without loading a
    model. Processes wait for each other's build on a lock (pytest's workers)."""
    root.mkdir(parents=True, exist_ok=True)
    export = root / "model"
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        folder = _source(export_source(model_dir, source), root / "hf")
        if not _up_to_date(folder, export):
            export_tiny(folder, export, VARIANTS, ("--logit-tolerance", str(LOGIT_TOLERANCE)))
    return export


def _up_to_date(source: Path, export: Path) -> bool:
    return up_to_date(export, EXPORT_MARK, source_fingerprint(source)) and all(
        up_to_date(variant_dir(export, v), VARIANT_MARK, fingerprint(export, RECIPES[v])) for v in VARIANTS)


def _source(base: Path, folder: Path) -> Path:
    """The tiny model's Hugging Face folder, written again only when its recipe or its base (a GGUF file or a Hugging
    Face folder: `make model`'s source) changed (the export's mark holds the folder's time, so a folder written again
    is exported again)."""
    recipe = json.dumps({**RECIPE, "version": VERSION, "base": source_fingerprint(base)}, sort_keys=True)
    if (folder / RECIPE_FILE).is_file() and (folder / RECIPE_FILE).read_text() == recipe:
        return folder
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from scripts.prepare.gguf_reader import parsed_once

    shutil.rmtree(folder, ignore_errors=True)
    if base.is_file():  # a GGUF file
        where = {"pretrained_model_name_or_path": base.parent, "gguf_file": base.name}
    else:
        where = {"pretrained_model_name_or_path": base}
    with parsed_once():  # as the export reads it: the tokenizer the export saves, the config of its weights
        AutoTokenizer.from_pretrained(**where, local_files_only=True).save_pretrained(folder)
        config = LlamaConfig.from_pretrained(**where, local_files_only=True)
    config.update({k: v for k, v in RECIPE.items() if k != "seed"})
    torch.manual_seed(RECIPE["seed"])
    LlamaForCausalLM(config).save_pretrained(folder)
    (folder / RECIPE_FILE).write_text(recipe)
    return folder


if __name__ == "__main__":  # make tiny-model: [the real export's folder, [make model's SOURCE]]
    built = tiny_engine_model(Path(sys.argv[1]) if len(sys.argv) > 1 else EXPORT_DIR,
                              source=Path(sys.argv[2]) if len(sys.argv) > 2 else None)
    weights = hashlib.sha256((ROOT / "hf" / "model.safetensors").read_bytes()).hexdigest()[:16]
    report = json.loads((built / PARITY_REPORT_FILE).read_text())
    print(f"{built}: weights {weights}, max |Δ logits| {report['max_abs_logit_diff']:.2e} against transformers")
