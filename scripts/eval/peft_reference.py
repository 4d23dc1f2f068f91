"""LoRA adapters made with PEFT on a base model, and PEFT's own greedy tokens with each: what the served adapters are
checked against (tests/test_lora.py). Runs in the eval venv (`make eval-venv`: `.venv-eval`, where lm-eval's hf
extra brings PEFT); nothing is downloaded.

    .venv-eval/bin/python -m scripts.eval.peft_reference --base build/model/hf --output build/lora \\
        --adapter sql:8:16:q_proj,v_proj --adapter chat:16:32:all:rslora --prompts prompts.json --max-tokens 16

Each ``--adapter NAME:RANK:ALPHA:TARGETS[:rslora]`` (TARGETS: comma-separated module names, or ``all`` for the
attention and MLP projections) is a PEFT LoRA on the base with PEFT's own initialisation of A, and B drawn at random
(seeded; PEFT starts B at zero, which would change nothing), saved with ``save_pretrained`` into OUTPUT/NAME. With
``--prompts`` (a JSON list of token-id lists), OUTPUT/reference.json maps each adapter's name (and ``""``: the base)
to the greedy new tokens of each prompt, from PEFT's model in fp32 (transformers' ``generate``, EOS kept out; with
``--no-end`` exactly ``--max-tokens`` each, prompts batched; without it, OUTPUT/runners_up.json holds each step's
runner-up token and its distance: the near ties). ``--load NAME=FOLDER`` answers with an existing PEFT
folder instead of making one; ``--logit-prompts`` adds each prompt's last logits (OUTPUT/logits.npz): what
scripts/eval/lora_parity.py judges a variant's adapters by.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EVAL_PYTHON = ROOT / ".venv-eval" / "bin" / "python"  # where PEFT is (make eval-venv)
REFERENCE_DIR = ROOT / "build" / "peft-reference"
DONE_FILE = "done"
RUNNERS_UP_FILE = "runners_up.json"  # name -> each prompt's [runner-up token, its logit's distance] at each step
ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
B_STD = 0.05  # large enough that greedy answers change on SmolLM2-135M (tests/test_lora.py checks that they do)


def cached_run(arguments: list[str], files: dict[str, object], made_of: list[str], timeout_s: float = 900) -> Path:
    """Runs this script in the eval venv (called from the main one), once per digest of what makes its answers (this
    script, ``made_of``, the files, the arguments): its output folder under REFERENCE_DIR. Each of ``files`` is
    written there as NAME.json and passed as --NAME (prompts, logit-prompts). RuntimeError with PEFT's error."""
    import hashlib
    import subprocess

    key = "\0".join([Path(__file__).read_text(), *made_of, json.dumps(files), *arguments])
    folder = REFERENCE_DIR / hashlib.sha256(key.encode()).hexdigest()[:16]
    if not (folder / DONE_FILE).is_file():
        folder.mkdir(parents=True, exist_ok=True)
        command = [str(EVAL_PYTHON), "-m", "scripts.eval.peft_reference", "--output", str(folder), *arguments]
        for name, value in files.items():
            (folder / f"{name}.json").write_text(json.dumps(value))
            command += [f"--{name}", str(folder / f"{name}.json")]
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
        if done.returncode:
            raise RuntimeError(f"PEFT's reference failed:\n{done.stderr[-3000:]}")
        (folder / DONE_FILE).write_text("")
    return folder


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
    return greedy_with_runners_up(model, ids, max_tokens, eos, **generate_args)[0]


def greedy_with_runners_up(model, ids: list[int], max_tokens: int, eos: list[int],
                           **generate_args) -> tuple[list[int], list[tuple[int, float]]]:
    """greedy_ids, and at each step (the one that chose an end token too) the runner-up token and how far its logit
    is below the chosen one's (the model's logits, before any logits processor): where another runtime's rounding
    may choose otherwise (a near tie)."""
    import torch

    generate_args.setdefault("eos_token_id", eos)  # these end it, not only the model's own
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.int64),
                             max_new_tokens=max_tokens, do_sample=False, pad_token_id=eos[0], output_logits=True,
                             return_dict_in_generate=True, **generate_args)
    new = out.sequences[0, len(ids):].tolist()
    stops = [i for i, t in enumerate(new) if t in eos]
    top = [step[0].float().topk(2) for step in out.logits]
    runners_up = [(int(t.indices[1]), float(t.values[0] - t.values[1])) for t in top]
    return (new[: stops[0]] if stops else new), runners_up[: stops[0] + 1 if stops else len(new)]


def departure(answer: list[int], expected: list[int], runners_up: list, eos: list[int], near_tie: float) -> str | None:
    """None when a greedy answer is the expected one (with its runners-up: greedy_with_runners_up), or leaves it only
    at a near tie (the top two logits under near_tie apart) and only for the runner-up: there another runtime's
    rounding may choose it, and the two are other answers from then on. Else where and how it left."""
    n = next((i for i, (a, b) in enumerate(zip(answer, expected)) if a != b), min(len(answer), len(expected)))
    if n == len(answer) == len(expected):
        return None
    if n >= len(runners_up):
        return f"token {n}: past the reference's last step"
    chosen = answer[n] if n < len(answer) else None  # None: the answer ended there
    runner_up, gap = runners_up[n]
    if gap < near_tie and (chosen == runner_up or (chosen is None and runner_up in eos)):
        return None
    return (f"token {n}: {'end' if chosen is None else chosen} against {expected[n] if n < len(expected) else 'end'} "
            f"(runner-up {runner_up}, {gap:.3g} below)")


def load_adapter(base_dir: Path, folder: Path):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    return PeftModel.from_pretrained(model, folder).eval()


def last_logits(model, prompts: list[list[int]]):
    """The last position's logits of each prompt alone [prompts, vocab] (numpy)."""
    import torch

    with torch.no_grad():
        return torch.cat([model(input_ids=torch.tensor([ids])).logits[:, -1] for ids in prompts]).numpy()


def pytorch_greedy(model, prompts: list[list[int]], tokens: int, batch_size: int = 64) -> list[list[int]]:
    """fp32 PyTorch's greedy tokens, prompts of similar length batched together: left-padded, the padding masked and
    the positions counted from the mask, as transformers' generate() does. On the served model this gives the tokens of
    one prompt at a time on all 42 load-test prompts over 64 tokens, in 21.5 s against 105 s (measured 2026-12-02)."""
    import torch

    answers: list[list[int] | None] = [None] * len(prompts)
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    for start in range(0, len(order), batch_size):
        rows = order[start:start + batch_size]
        longest = max(len(prompts[i]) for i in rows)
        ids = torch.tensor([[0] * (longest - len(prompts[i])) + prompts[i] for i in rows])
        mask = torch.tensor([[0] * (longest - len(prompts[i])) + [1] * len(prompts[i]) for i in rows])
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
            batch = out.logits[:, -1].argmax(-1)[:, None]
            chosen = [batch]
            for _ in range(tokens - 1):
                mask = torch.cat([mask, torch.ones_like(batch)], 1)
                positions = positions[:, -1:] + 1
                out = model(input_ids=batch, attention_mask=mask, position_ids=positions, cache=out.cache,
                            use_cache=True)
                batch = out.logits[:, -1].argmax(-1)[:, None]
                chosen.append(batch)
        for row, answer in zip(rows, torch.cat(chosen, 1).tolist()):
            answers[row] = answer
    return answers


def greedy(model, prompts: list[list[int]], max_tokens: int, eos: list[int]) -> list[tuple[list[int], list]]:
    return [greedy_with_runners_up(model, ids, max_tokens, eos) for ids in prompts]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", type=Path, required=True, help="the base model's Hugging Face folder")
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--adapter", action="append", default=[], help="NAME:RANK:ALPHA:TARGETS[:rslora]")
    parser.add_argument("--prompts", type=Path, help="a JSON list of prompts' token ids")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--eos", default="", help="comma-separated end token ids (default: the base config's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--load", action="append", default=[], metavar="NAME=FOLDER",
                        help="an existing PEFT folder to answer with (besides or instead of --adapter)")
    parser.add_argument("--no-end", action="store_true",
                        help="each answer exactly --max-tokens long, end tokens not stopping it (as the variants' "
                             "parity: scripts/prepare/variant_parity.py), prompts batched")
    parser.add_argument("--logit-prompts", type=Path,
                        help="a JSON list of prompts' token ids: the last position's logits of each, per adapter, "
                             "into OUTPUT/logits.npz")
    args = parser.parse_args(argv)
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(max(1, torch.get_num_threads()))
    args.output.mkdir(parents=True, exist_ok=True)
    prompts = json.loads(args.prompts.read_text()) if args.prompts else []
    config = json.loads((args.base / "config.json").read_text())
    eos = [int(t) for t in args.eos.split(",")] if args.eos else \
        [config["eos_token_id"]] if isinstance(config["eos_token_id"], int) else list(config["eos_token_id"])
    logit_prompts = json.loads(args.logit_prompts.read_text()) if args.logit_prompts else []
    reference, runners_up, logits = {}, {}, {}

    def answer(name, model):
        if prompts and args.no_end:
            reference[name] = pytorch_greedy(model, prompts, args.max_tokens)
        elif prompts:
            reference[name], runners_up[name] = map(list, zip(*greedy(model, prompts, args.max_tokens, eos)))
        if logit_prompts:
            logits[name or "base"] = last_logits(model, logit_prompts)

    if prompts or logit_prompts:
        answer("", AutoModelForCausalLM.from_pretrained(args.base, dtype=torch.float32).eval())
    for i, spec in enumerate(parse_adapter(s) for s in args.adapter):
        answer(spec["name"], make_adapter(args.base, spec, args.output, args.seed + i))
    for item in args.load:
        name, _, folder = item.partition("=")
        answer(name, load_adapter(args.base, Path(folder)))
    if prompts:
        (args.output / "reference.json").write_text(json.dumps(reference))
    if runners_up:
        (args.output / RUNNERS_UP_FILE).write_text(json.dumps(runners_up))
    if logit_prompts:
        import numpy as np

        np.savez(args.output / "logits.npz", **logits)
    print(f"[peft] {len(args.adapter)} adapters in {args.output}" + (f"; references of {len(prompts)} prompts"
                                                                      if prompts else ""), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
