"""LoRA adapters made with PEFT on a base model, and PEFT's own greedy tokens with each: what the served adapters are
checked against (tests/test_lora.py). Runs in the eval venv (`make eval-venv`: `.venv-eval`, where lm-eval's hf
extra brings PEFT); nothing is downloaded.

    .venv-eval/bin/python -m scripts.eval.peft_reference --base build/model/hf --output build/lora \\
        --adapter sql:8:16:q_proj,v_proj --adapter chat:16:32:all:rslora --prompts prompts.json --max-tokens 16

Each ``--adapter NAME:RANK:ALPHA:TARGETS[:rslora]`` (TARGETS: comma-separated module names, or ``all`` for the
attention and MLP projections) is a PEFT LoRA on the base with PEFT's own initialisation of A, and B drawn at random
(seeded; PEFT starts B at zero, which would change nothing), saved with ``save_pretrained`` into OUTPUT/NAME. With
``--prompts`` (a JSON list of token-id lists), OUTPUT/reference.json maps each adapter's name (and ``""``: the base)
to the greedy new tokens of each prompt, from PEFT's model in fp32 (transformers' ``generate``, EOS kept out).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
B_STD = 0.05  # large enough that greedy answers change on SmolLM2-135M (tests/test_lora.py checks that they do)


def parse_adapter(spec: str) -> dict:
    parts = spec.split(":")
    if len(parts) not in (4, 5) or (len(parts) == 5 and parts[4] != "rslora"):
        raise SystemExit(f"--adapter {spec!r}: expected NAME:RANK:ALPHA:TARGETS[:rslora]")
    name, rank, alpha, targets = parts[:4]
    return {"name": name, "r": int(rank), "lora_alpha": int(alpha), "use_rslora": len(parts) == 5,
            "target_modules": ALL_TARGETS if targets == "all" else targets.split(",")}


def make_adapter(base_dir: Path, spec: dict, output: Path, seed: int):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(r=spec["r"], lora_alpha=spec["lora_alpha"], use_rslora=spec["use_rslora"],
                        target_modules=spec["target_modules"], lora_dropout=0.0, task_type="CAUSAL_LM")
    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0.0, B_STD)
    peft_model.save_pretrained(output / spec["name"])
    return peft_model.eval()


def greedy_ids(model, ids: list[int], max_tokens: int, eos: list[int], **generate_args) -> list[int]:
    """transformers' greedy generate() from these prompt ids (a PEFT model's too): the new token ids, up to the
    first end token (tests/helpers.py's transformers reference is this)."""
    import torch

    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.int64),
                             max_new_tokens=max_tokens, do_sample=False, pad_token_id=eos[0], **generate_args)
    new = out[0, len(ids):].tolist()
    stops = [i for i, t in enumerate(new) if t in eos]
    return new[: stops[0]] if stops else new


def greedy(model, prompts: list[list[int]], max_tokens: int, eos: list[int]) -> list[list[int]]:
    return [greedy_ids(model, ids, max_tokens, eos) for ids in prompts]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", type=Path, required=True, help="the base model's Hugging Face folder")
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--adapter", action="append", default=[], help="NAME:RANK:ALPHA:TARGETS[:rslora]")
    parser.add_argument("--prompts", type=Path, help="a JSON list of prompts' token ids")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--eos", default="", help="comma-separated end token ids (default: the base config's)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(max(1, torch.get_num_threads()))
    args.output.mkdir(parents=True, exist_ok=True)
    prompts = json.loads(args.prompts.read_text()) if args.prompts else []
    config = json.loads((args.base / "config.json").read_text())
    eos = [int(t) for t in args.eos.split(",")] if args.eos else \
        [config["eos_token_id"]] if isinstance(config["eos_token_id"], int) else list(config["eos_token_id"])
    reference = {}
    if prompts:
        base = AutoModelForCausalLM.from_pretrained(args.base, dtype=torch.float32).eval()
        reference[""] = greedy(base, prompts, args.max_tokens, eos)
    for i, spec in enumerate(parse_adapter(s) for s in args.adapter):
        model = make_adapter(args.base, spec, args.output, args.seed + i)
        if prompts:
            reference[spec["name"]] = greedy(model, prompts, args.max_tokens, eos)
    if prompts:
        (args.output / "reference.json").write_text(json.dumps(reference))
    print(f"[peft] {len(args.adapter)} adapters in {args.output}" + (f"; references of {len(prompts)} prompts"
                                                                      if prompts else ""), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
