"""How close an exported decoder (fp32 or a quantized variant) stays to the fp32 PyTorch model.

Two measures, written to the folder's parity report:
- logits: max |Δ| of the last position's logits against transformers, on a left-padded batch of prompts, prefill and
  a few decode steps (the same check the fp32 export passes at 1e-3);
- greedy agreement on the load-test prompts (loadtests/prompts.jsonl, raw text): GREEDY_TOKENS greedy tokens from the
  engine on this decoder (all prompts batched, EOS not stopping) against fp32 PyTorch one prompt at a time; how many
  prompts are identical over all the tokens, and the mean number of tokens before the first difference.
The PyTorch references (the greedy tokens, the logits) are computed once and kept in the fp32 export's folder
(GREEDY_REFERENCE_FILE, LOGIT_REFERENCE_FILE): a variant's check loads no PyTorch model when both are there.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from loadtests.workload import DEFAULT_PROMPTS as LOAD_TEST_PROMPTS
from python_backend.engine.core import open_kv_cache
from python_backend.engine.loop import generate
from python_backend.engine.sampling import SamplingParams
from python_backend.engine.scheduler import SchedulerConfig
from python_backend.engine.sequence import Sequence
from python_backend.model_files import ONNX_FILE, PARITY_REPORT_FILE, SETTINGS_FILE
from python_backend.runtime.factory import cpu_decoder
from python_backend.serving.tokenization import PromptTokenizer
from scripts.eval.peft_reference import pytorch_greedy

GREEDY_REFERENCE_FILE = "greedy_reference.json"
LOGIT_REFERENCE_FILE = "logit_reference.npz"
# The export's own check of transformers' generate() (scripts/prepare/export_onnx.py), kept beside them.
GENERATE_REFERENCE_FILE = "generate_reference.json"
GREEDY_TOKENS = 64
LOGIT_PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that returns the sum of a list of numbers.",
    "用一句话介绍一下长城。",
    "Explain in two sentences why the sky is blue, and mention the scientist who first described it.",
]
DECODE_STEPS_CHECKED = 4
# What `make test` holds each variant's report to: (max |Δ logits|, share of prompts greedy-identical over
# GREEDY_TOKENS). Set from the measured reports (docs/models.md), with a margin for other CPUs.
THRESHOLDS = {
    "fp32": (1e-3, 0.95),
    "int4": (1e-3, 0.95),  # measured 9.25e-5, 42 of 42 (the fused graph; 9.9e-5 on the export's)
    "fp16": (0.1, 0.9),  # measured 0.037, 42 of 42
    "fast": (3.0, 0.15),  # measured 1.48, 10 of 42 (int8 on the fused graph; 1.66, 12 of 42 on the export's)
}


def log(message: str) -> None:
    print(f"[parity] {message}", file=sys.stderr, flush=True)


def load_test_prompts() -> list[str]:
    lines = LOAD_TEST_PROMPTS.read_text(encoding="utf-8").splitlines()
    return [json.loads(line)["text_input"] for line in lines if line.strip()]


def load_reference_model(hf_dir: str | Path):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager").eval()


@dataclass
class LogitReference:
    """fp32 PyTorch's last-position logits for prompts in one left-padded batch: at the prefill and after each decode
    step, each step fed PyTorch's own greedy tokens."""
    prompts: list[list[int]]
    fed: list[np.ndarray]  # [rows] token ids, one array per decode step
    logits: list[np.ndarray]  # [rows, vocabulary], one array before each step and one after the last


def pytorch_logits(model, prompts: list[list[int]], decode_steps: int) -> LogitReference:
    """The reference computed with PyTorch's own KV cache."""
    import torch

    longest = max(len(p) for p in prompts)
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts])
    ids = torch.tensor([[0] * (longest - len(p)) + p for p in prompts])
    fed, logits = [], []
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0),
                    use_cache=True, logits_to_keep=1)
        for _ in range(decode_steps):
            logits.append(out.logits[:, -1].numpy())
            fed.append(logits[-1].argmax(-1))
            mask = torch.cat([mask, torch.ones(len(prompts), 1, dtype=mask.dtype)], 1)
            out = model(input_ids=torch.from_numpy(fed[-1])[:, None], attention_mask=mask,
                        position_ids=mask.sum(1, keepdim=True) - 1, cache=out.cache, use_cache=True)
        logits.append(out.logits[:, -1].numpy())
    return LogitReference(prompts, fed, logits)


def logit_reference(fp32_dir: Path, load_model, prompts: list[list[int]], decode_steps: int) -> LogitReference:
    """The reference for these prompts, from the fp32 export's cache file when it was made for them (the export
    writes it: each variant's check then needs no PyTorch model); load_model() gives the model when it must be
    computed."""
    key = hashlib.sha256(json.dumps([prompts, decode_steps]).encode()).hexdigest()
    path = fp32_dir / LOGIT_REFERENCE_FILE
    if path.is_file():
        with np.load(path) as cached:
            if str(cached["key"]) == key:
                return LogitReference(prompts, list(cached["fed"]), list(cached["logits"]))
    reference = pytorch_logits(load_model(), prompts, decode_steps)
    with _written_whole(path) as partial, open(partial, "wb") as file:
        np.savez(file, key=key, fed=np.stack(reference.fed), logits=np.stack(reference.logits))
    return reference


@contextlib.contextmanager
def _written_whole(path: Path):
    """A file of this process's own to write, put in path's place at the end: the variants, built side by side
    (make -j), each read a reference file that another may be writing."""
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        yield partial
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


def logit_differences(decoder, reference: LogitReference) -> np.ndarray:
    """max |Δ| of each prompt's last-position logits [steps, prompts] of the decoder, through the engine's KV cache
    (its own layout), against the reference: the prefill (step 0), then each decode step fed the reference's
    tokens."""
    prompts = reference.prompts
    config = SchedulerConfig(max_batch_size=len(prompts), kv_layout=getattr(decoder, "kv_layout", "padded"),
                             max_context_length=max(len(p) for p in prompts) + len(reference.fed) + 1)
    cache = open_kv_cache(decoder, config)
    logits, _, _ = cache.prefill(prompts, [len(p) + len(reference.fed) + 1 for p in prompts])
    differences = [np.abs(logits - reference.logits[0]).max(axis=-1)]
    for tokens, expected in zip(reference.fed, reference.logits[1:]):
        differences.append(np.abs(cache.step(tokens) - expected).max(axis=-1))
    return np.stack(differences)


def max_abs_logit(reference: LogitReference) -> float:
    return float(max(np.abs(step).max() for step in reference.logits))


def max_logit_difference(decoder, reference: LogitReference) -> tuple[float, float]:
    """(max |Δ logits|, max |logit|) of the decoder against the reference (logit_differences)."""
    return float(logit_differences(decoder, reference).max()), max_abs_logit(reference)


def cached_json(path: Path, field: str, inputs, compute):
    """compute()'s value (JSON), kept in path as its field, with a key of the inputs it was computed from: read back
    from there while the inputs are the same."""
    key = hashlib.sha256(json.dumps(inputs).encode()).hexdigest()
    if path.is_file():
        cached = json.loads(path.read_text())
        if cached.get("key") == key and field in cached:
            return cached[field]
    value = compute()
    with _written_whole(path) as partial:
        partial.write_text(json.dumps({"key": key, field: value}))
    return json.loads(json.dumps(value))  # as a later read gives it back (tuples as lists)


def reference_greedy(fp32_dir: Path, load_model, prompts: list[list[int]]) -> list[list[int]]:
    """fp32 PyTorch's greedy tokens for the prompts, from the cache file when it was made for the same prompts;
    load_model() gives the model when they must be computed."""
    def compute():
        log(f"fp32 PyTorch greedy reference: {len(prompts)} prompts x {GREEDY_TOKENS} tokens, batched (~30 s)")
        return pytorch_greedy(load_model(), prompts, GREEDY_TOKENS)

    return cached_json(fp32_dir / GREEDY_REFERENCE_FILE, "tokens", [prompts, GREEDY_TOKENS], compute)


def engine_greedy(decoder, prompts: list[list[int]]) -> list[list[int]]:

    params = SamplingParams(max_tokens=GREEDY_TOKENS)  # no end_ids: EOS does not stop the comparison
    sequences = [Sequence(prompt_ids=p, params=params) for p in prompts]
    generate(decoder, sequences)
    return [s.output_ids for s in sequences]


def agreement(answers: list[list[int]], reference: list[list[int]]) -> dict:
    first_differences = [next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), len(theirs))
                         for mine, theirs in zip(answers, reference)]
    identical = sum(d == len(r) for d, r in zip(first_differences, reference))
    return {"prompts": len(reference), "tokens": GREEDY_TOKENS, "identical": identical,
            "identical_share": identical / len(reference),
            "mean_tokens_to_first_difference": float(np.mean(first_differences)),
            "first_differences": first_differences}


def measure(fp32_dir: Path, model_dir: Path) -> dict:
    """Both measures for the decoder in model_dir; fp32_dir holds the export (its hf folder and the references)."""
    settings = json.loads((fp32_dir / SETTINGS_FILE).read_text())
    load_model = functools.cache(lambda: load_reference_model(settings["hf_dir"]))  # only if a reference is missing
    tokenizer = PromptTokenizer(fp32_dir)
    decoder = cpu_decoder(model_dir / ONNX_FILE)
    log(f"{model_dir.name}: logits against fp32 PyTorch")
    logit_prompts = [tokenizer.encode(p, apply_chat_template=True) for p in LOGIT_PROMPTS]
    reference = logit_reference(fp32_dir, load_model, logit_prompts, DECODE_STEPS_CHECKED)
    max_diff, max_logit = max_logit_difference(decoder, reference)
    prompts = [tokenizer.encode(p, apply_chat_template=False) for p in load_test_prompts()]
    greedy = reference_greedy(fp32_dir, load_model, prompts)
    log(f"{model_dir.name}: greedy, {len(prompts)} load-test prompts x {GREEDY_TOKENS} tokens")
    return {"max_abs_logit_diff": max_diff, "max_abs_logit": max_logit,
            "logits_checked": f"last position of a batch of {len(LOGIT_PROMPTS)}, prefill and "
                              f"{DECODE_STEPS_CHECKED} decode steps, against fp32 PyTorch",
            "greedy_agreement": agreement(engine_greedy(decoder, prompts), greedy)}


def judge(variant: str, measured: dict) -> dict:
    max_diff, share = THRESHOLDS[variant]
    passed = (measured["max_abs_logit_diff"] <= max_diff
              and measured["greedy_agreement"]["identical_share"] >= share)
    return {**measured, "thresholds": {"max_abs_logit_diff": max_diff, "greedy_identical_share": share},
            "passed": passed}


def check_variant(fp32_dir: Path, variant_dir: Path, variant: str, build: dict) -> dict:
    report = {"variant": variant, "build": build, **judge(variant, measure(fp32_dir, variant_dir))}
    (variant_dir / PARITY_REPORT_FILE).write_text(json.dumps(report, indent=2))
    g = report["greedy_agreement"]
    log(f"{variant}: max |Δ logits| {report['max_abs_logit_diff']:.3g}; greedy identical {g['identical']}/"
        f"{g['prompts']} over {g['tokens']} tokens, mean {g['mean_tokens_to_first_difference']:.1f} tokens to the "
        f"first difference; {'passed' if report['passed'] else 'FAILED'}")
    return report
