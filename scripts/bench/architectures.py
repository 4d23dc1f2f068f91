"""Which architectures each weight variant serves: tiny random models of the architectures people bring (SmolLM2's
tokenizer, a few layers, random weights large enough that every token depends on the prompt), each exported and built
as every variant, with each build's parity line or refusal, and its `fp32` variant (what `make serve` builds by
default) served by a real tritonserver, its greedy tokens compared with transformers'. Prints the table docs/models.md
shows.

    python -m scripts.bench.architectures [--work build/architectures] [--only qwen2 gemma2]

Random weights are on no 4-bit grid, so `int4` (exact only on a GGUF's own grid) is refused for every one of them
before any work: the table says so rather than forcing a build. Nothing is downloaded: the configs are written here.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

from scripts.bench.workload import NEVER_WRITTEN
from scripts.paths import PROJECT_ROOT

VARIANTS = ("fp32", "fp16", "fast", "int4")
SERVED_PROMPTS = ["The quick brown fox", "用一句话介绍一下长城。", "def add(a, b):", "Name three ports in Europe."]
SERVED_TOKENS = 24
SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=512, initializer_range=0.2)


def configs(tokenizer, layers: int = SMALL["num_hidden_layers"]) -> dict:
    """Architecture -> a tiny config with what sets it apart switched on (in every layer: the tests take 2)."""
    import transformers as tf

    ids = dict(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
               pad_token_id=tokenizer.pad_token_id)
    small = {**SMALL, "num_hidden_layers": layers}
    return {
        "llama3 (rope scaling)": tf.LlamaConfig(**small, **ids, head_dim=16, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
        "mistral": tf.MistralConfig(**small, **ids, head_dim=16, sliding_window=None),
        "qwen2 (biases)": tf.Qwen2Config(**small, **ids),
        "qwen3 (q/k norms)": tf.Qwen3Config(**small, **ids, head_dim=16),
        # As Phi-3-mini-4k: its context is the one it was trained at (a longer one means LongRoPE's factors).
        "phi3 (fused projections)": tf.Phi3Config(**small, **ids, original_max_position_embeddings=512),
        "gemma2 (soft caps, sliding window)": tf.Gemma2Config(
            **small, **ids, head_dim=16, sliding_window=32, query_pre_attn_scalar=16, attn_logit_softcapping=5.0,
            final_logit_softcapping=30.0),
        "granite (multipliers)": tf.GraniteConfig(**small, **ids, embedding_multiplier=12.0, residual_multiplier=0.22,
                                                  attention_multiplier=0.0625, logits_scaling=8.0),
        "olmo2 (post-norms, q/k norms)": tf.Olmo2Config(**small, **ids),
    }


def make(config, tokenizer, folder: Path) -> None:
    """A Hugging Face folder: the tokenizer and the config's model with seeded random weights."""
    import torch
    from transformers import AutoModelForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(folder)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # transformers starts biases at zero, where a bias left out would change nothing
        for name, parameter in model.named_parameters():
            if name.endswith(".bias"):
                parameter.normal_(0.0, config.initializer_range)
    model.save_pretrained(folder)


def run(command: list[str]) -> tuple[int, str]:
    done = subprocess.run([sys.executable, "-m", *command], cwd=PROJECT_ROOT, capture_output=True, text=True)
    return done.returncode, done.stdout + done.stderr


# The parity lines the builds print: the export's (its load-test agreement after the 4 generate() prompts), a
# variant's.
PARITY_LINES = (r"max \|Δ logits\| = ([0-9.e+-]+) .*?on the load-test prompts (\d+)/(\d+) over",
                r"max \|Δ logits\| ([0-9.e+-]+); greedy identical (\d+)/(\d+) over")
REFUSALS = ((r"exact only for weights already on a 4-bit grid", "refused: off its grid"),
            (r"has sliding-window layers", "refused: sliding window"),
            (r"model builder does not take", "refused: not in onnxruntime-genai's builder"))


def outcome(code: int, log: str) -> str:
    """One cell: the parity line's numbers, or why it was refused or failed."""
    for pattern in PARITY_LINES:
        if found := re.search(pattern, log):
            delta, same, total = found.groups()
            graph = " (on the export's graph)" if "built on the export's own graph" in log else ""
            return f"{'built' if code == 0 else 'FAILED'}: {float(delta):.2g}, {same}/{total}{graph}"
    for pattern, label in REFUSALS:
        if re.search(pattern, log):
            return label
    if found := re.search(r"cannot export .*", log):
        return f"refused: {found.group(0)[:80]}"
    last = [line for line in log.strip().splitlines() if line.strip()][-1:] or ["(no output)"]
    return f"failed (exit {code}): {last[0][:100]}"


def served(source: Path, variant: Path, tokenizer, log_path: Path) -> str:
    """The variant served by a real tritonserver: on how many prompts its greedy text (raw prompts, no template) is
    transformers' own fp32 eager generate() on the source folder."""
    import torch
    from transformers import AutoModelForCausalLM

    from python_backend.model_files import MODEL_DIR_ENV
    from scripts.clients.llm_client import GenerateClient
    from scripts.eval.peft_reference import greedy_ids
    from scripts.launcher.triton_server import running_server

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32, attn_implementation="eager").eval()
    same = 0
    try:
        with running_server(log_path=log_path, env={MODEL_DIR_ENV: str(variant)}) as ports:
            client = GenerateClient(f"127.0.0.1:{ports.http}")
            for prompt in SERVED_PROMPTS:
                # one end id for both: the server stops at end_id, transformers at eos_token_id
                expected = greedy_ids(model, tokenizer(prompt).input_ids, SERVED_TOKENS, [NEVER_WRITTEN],
                                      eos_token_id=NEVER_WRITTEN)
                completion = client.complete({"text_input": prompt, "max_tokens": SERVED_TOKENS,
                                              "end_id": NEVER_WRITTEN, "apply_chat_template": False})
                same += 0 < completion.output_tokens == len(expected) and completion.text == tokenizer.decode(
                    expected, skip_special_tokens=True)
    except Exception as error:  # noqa: BLE001 - a cell of the table, with the server's log kept
        return f"failed: {type(error).__name__} (log: {log_path})"
    return f"{same}/{len(SERVED_PROMPTS)} token-exact"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=PROJECT_ROOT / "build" / "architectures")
    parser.add_argument("--only", nargs="*", help="architectures whose name starts with one of these")
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    from scripts.paths import default_model_dir

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir(), local_files_only=True)
    rows = []
    for name, config in configs(tokenizer).items():
        if args.only and not any(name.startswith(prefix) for prefix in args.only):
            continue
        slug = name.split()[0]
        source, export = args.work / slug, args.work / f"{slug}-export"
        make(config, tokenizer, source)
        code, log = run(["scripts.prepare.export_onnx", "--source", str(source), "--output", str(export), "--force"])
        cells = [outcome(code, log)]
        for variant in VARIANTS:
            cells.append(outcome(*run(["scripts.prepare.quantize", "--quant", variant, "--source", str(export),
                                        "--force"])) if code == 0 else "-")
        fp32 = args.work / f"{slug}-export-fp32"
        cells.append(served(source, fp32, tokenizer, args.work / f"{slug}-server.log")
                     if cells[1].startswith("built") else "-")
        rows.append((name, cells))
        print(f"{name}: {' | '.join(cells)}", file=sys.stderr, flush=True)
    print("| architecture | the export | " + " | ".join(VARIANTS) + f" | `fp32` served ({SERVED_TOKENS} tokens) |")
    print("| --- | --- | " + " | ".join("---" for _ in VARIANTS) + " | --- |")
    for name, cells in rows:
        print(f"| {name} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
