"""A variant's LoRA parity report: its adapter graph with each adapter against PEFT's own model in fp32 (issue 35).

    python -m scripts.eval.lora_parity --model-dir build/model-int4 --adapter sql=build/lora/sql --adapter ...

The variant's base products are its own (int4's 4-bit blocks, fp16's matrices, ...) and each adapter's delta is fp32
(scripts/prepare/lora_graph.py). Measured as scripts/prepare/variant_parity.py measures a variant:
- logits: max |Δ| of the last position's logits of its LOGIT_PROMPTS (each prompt alone) against PEFT's;
- greedy: GREEDY_TOKENS tokens for each load-test prompt (end tokens not stopping), every adapter's rows and the base's
  mixed in one engine run, against PEFT's model for that adapter (fp32, transformers, prompts batched): prompts
  identical over all the tokens, and the mean number of tokens before the first difference.
Judged by the variant's thresholds (variant_parity.THRESHOLDS) and written to --output (default: the variant's folder,
LORA_PARITY_FILE). PEFT runs in the eval venv (`make eval-venv`; scripts/eval/peft_reference.py); its answers are kept
under build/peft-reference/ by a digest of what makes them.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import numpy as np

from python_backend.engine.core import open_kv_cache
from python_backend.engine.loop import generate
from python_backend.engine.sampling import SamplingParams
from python_backend.engine.scheduler import SchedulerConfig
from python_backend.engine.sequence import Sequence
from python_backend.lora import AdapterError, BaseShapes, parse_modules, read_peft
from python_backend.model_files import ADAPTER_ONNX_FILE, SETTINGS_FILE
from python_backend.runtime.onnx_slot_decoder import OnnxSlotDecoder
from python_backend.serving.tokenization import PromptTokenizer
from scripts.eval.peft_reference import EVAL_PYTHON, cached_run
from scripts.prepare.variant_parity import GREEDY_TOKENS, LOGIT_PROMPTS, agreement, load_test_prompts
from scripts.prepare.variant_parity import judge as variant_judge

LORA_PARITY_FILE = "lora_parity.json"


def peft_answers(base_dir: Path, adapters: dict[str, Path], prompts: list[list[int]], logit_prompts: list[list[int]],
                 tokens: int) -> tuple[dict, dict]:
    """PEFT's greedy tokens (name -> per prompt) and last logits (name -> [prompts, vocab]) for each adapter and the
    base (name ""), made once per digest of their inputs."""
    if not EVAL_PYTHON.exists():
        raise SystemExit(f"{EVAL_PYTHON} is missing (PEFT lives in the eval venv): make eval-venv")
    made_of = [(base_dir / "config.json").read_text()]
    for name, folder in sorted(adapters.items()):
        made_of += [name, (folder / "adapter_config.json").read_text(),
                    hashlib.sha256((folder / "adapter_model.safetensors").read_bytes()).hexdigest()]
    arguments = ["--base", str(base_dir), "--max-tokens", str(tokens), "--no-end",
                 *(f"--load={name}={folder}" for name, folder in adapters.items())]
    try:
        out = cached_run(arguments, {"prompts": prompts, "logit-prompts": logit_prompts}, made_of)
    except RuntimeError as error:
        raise SystemExit(str(error)) from None
    logits = np.load(out / "logits.npz")
    return json.loads((out / "reference.json").read_text()), {name: logits[name] for name in logits.files}


def last_logits(decoder, prompts: list[list[int]], adapter) -> np.ndarray:
    """The variant's last-position logits of each prompt alone, with this adapter."""
    rows = []
    for prompt in prompts:
        cache = open_kv_cache(decoder, SchedulerConfig(max_batch_size=1, kv_layout="slots",
                                                       max_context_length=len(prompt) + 1))
        logits, _, _ = cache.prefill([prompt], [len(prompt) + 1], adapters=[adapter])
        rows.append(np.asarray(logits).reshape(-1)[-decoder.vocab_size:])
        cache.clear()
    return np.stack(rows)


def measure(model_dir: Path, adapters: dict[str, Path], prompt_count: int, tokens: int) -> dict:
    settings = json.loads((model_dir / SETTINGS_FILE).read_text())
    if "lora_base" not in settings or not (model_dir / ADAPTER_ONNX_FILE).is_file():
        raise SystemExit(f"{model_dir} has no adapter graph: build the variant again (make variants)")
    base = BaseShapes.from_json(settings["lora_base"])
    loaded = {name: read_peft(folder, name, base) for name, folder in adapters.items()}
    tokenizer = PromptTokenizer(model_dir)
    prompts = [tokenizer.encode(p, apply_chat_template=False) for p in load_test_prompts()[:prompt_count]]
    logit_prompts = [tokenizer.encode(p, apply_chat_template=True) for p in LOGIT_PROMPTS]
    reference, reference_logits = peft_answers(Path(settings["hf_dir"]), adapters, prompts, logit_prompts, tokens)

    decoder = OnnxSlotDecoder(model_dir / ADAPTER_ONNX_FILE)
    names = ["", *adapters]
    sequences = {name: [Sequence(prompt_ids=p, params=SamplingParams(max_tokens=tokens), adapter=loaded.get(name))
                        for p in prompts] for name in names}
    generate(decoder, [s for name in names for s in sequences[name]], strategy="continuous")  # all mixed
    report = {}
    for name in names:
        diff = float(np.abs(last_logits(decoder, logit_prompts, loaded.get(name))
                            - reference_logits[name or "base"]).max())
        greedy = agreement([s.output_ids for s in sequences[name]], reference[name])
        report[name or "base"] = {"max_abs_logit_diff": diff, "greedy_agreement": {**greedy, "tokens": tokens}}
    return {"variant": settings.get("quantization"), "model_dir": str(model_dir),
            "adapters": {name: str(folder) for name, folder in adapters.items()},
            "logits_checked": f"last position of each of {len(LOGIT_PROMPTS)} prompts alone, against PEFT's fp32",
            "greedy_checked": f"{len(prompts)} load-test prompts x {tokens} tokens, the adapters' and the base's rows "
                              "mixed in one engine run, against PEFT's fp32 greedy", "results": report}


def judge(measured: dict) -> dict:
    """Each adapter's results held to the variant's thresholds, as variant_parity judges the variant itself."""
    results = {name: variant_judge(measured["variant"], result) for name, result in measured["results"].items()}
    return {**measured, "results": results, "thresholds": next(iter(results.values()))["thresholds"],
            "passed": all(r["passed"] for r in results.values())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, default=Path("build/model-int4"))
    parser.add_argument("--adapter", action="append", required=True, metavar="NAME=FOLDER", help="a PEFT folder")
    parser.add_argument("--prompts", type=int, default=len(load_test_prompts()), help="the first N load-test prompts")
    parser.add_argument("--tokens", type=int, default=GREEDY_TOKENS)
    parser.add_argument("--output", type=Path, help=f"the report (default: MODEL_DIR/{LORA_PARITY_FILE})")
    args = parser.parse_args(argv)
    try:
        adapters = {name: Path(folder).resolve() for name, folder in parse_modules(",".join(args.adapter)).items()}
    except AdapterError as error:
        parser.error(f"--adapter: {error}")
    report = judge(measure(args.model_dir, adapters, args.prompts, args.tokens))
    output = args.output or args.model_dir / LORA_PARITY_FILE
    output.write_text(json.dumps(report, indent=2))
    print(f"# LoRA parity: {args.model_dir} ({report['variant']}) against PEFT's fp32; {report['greedy_checked']}")
    print("| adapter | max abs logit diff | greedy identical | mean tokens to first difference | passed |")
    print("| --- | --- | --- | --- | --- |")
    for name, result in report["results"].items():
        g = result["greedy_agreement"]
        print(f"| {name} | {result['max_abs_logit_diff']:.3g} | {g['identical']}/{g['prompts']} | "
              f"{g['mean_tokens_to_first_difference']:.1f} | {result['passed']} |")
    print(f"thresholds {report['thresholds']}: {'passed' if report['passed'] else 'FAILED'}; written to {output}")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
