"""lm-eval (EleutherAI's lm-evaluation-harness, unchanged, from `make eval-venv`) against this server's OpenAI API, on
the repository's local tasks (scripts/eval/tasks/): starts Triton and the API on one weight variant, runs lm_eval,
prints its table.

    python -m scripts.eval.run                                     # the default variant, the multiple-choice task
    python -m scripts.eval.run --tasks triton_passages_ppl,triton_arithmetic_gen --limit 20
    python -m scripts.eval.run --chat --tasks triton_arithmetic_gen  # local-chat-completions (generation only)
    python -m scripts.eval.run --url http://127.0.0.1:9000          # a server already running

loglikelihood and loglikelihood_rolling tasks go through `/v1/completions` with token-id prompts, `echo` and
`logprobs` (lm-eval's `local-completions`); generate_until tasks through either endpoint. lm-eval's own results
(`--output_path`, with every request's log-likelihoods: `--log_samples`) are kept under --output.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path

from python_backend.model_files import MODEL_DIR_ENV
from scripts.launcher.model_control import SERVED_MODELS, reload_llm
from scripts.launcher.openai_server import running_openai_api
from scripts.launcher.triton_server import running_server
from scripts.paths import BUILD_DIR, EXPORT_DIR, PROJECT_ROOT
from scripts.prepare.quantize import variant_dir

LM_EVAL = PROJECT_ROOT / ".venv-eval" / "bin" / "lm_eval"
TASKS = PROJECT_ROOT / "scripts" / "eval" / "tasks"
LM_EVAL_TIMEOUT_S = 7200  # bounds a hung run only


def lm_eval_command(url: str, model: str, model_dir: Path, tasks: str, output: Path, *, chat: bool = False,
                    limit: int | None = None, concurrent: int = 4, batch_size: int = 8) -> list[str]:
    """lm_eval's command line for this server: local-completions (or local-chat-completions), the model's own
    tokenizer folder (nothing downloaded), several prompts per request (batch_size) and requests at once."""
    endpoint = "chat/completions" if chat else "completions"
    model_args = (f"model={model},base_url={url}/v1/{endpoint},tokenizer_backend=huggingface,tokenizer={model_dir},"
                  f"num_concurrent={concurrent},max_retries=1,tokenized_requests={not chat},timeout=1800")
    command = [str(LM_EVAL), "--model", "local-chat-completions" if chat else "local-completions",
               "--model_args", model_args, "--tasks", tasks, "--include_path", str(TASKS),
               "--output_path", str(output), "--log_samples", "--seed", "1234"]
    if chat:
        command += ["--apply_chat_template"]
    else:
        command += ["--batch_size", str(batch_size)]
    if limit:
        command += ["--limit", str(limit)]
    return command


def hf_command(hf_dir: Path, tasks: str, output: Path, batch_size: int | str, limit: int | None = None) -> list[str]:
    """lm_eval's own transformers backend on the same weights, on the CPU, in fp32."""
    command = [str(LM_EVAL), "--model", "hf", "--model_args", f"pretrained={hf_dir},dtype=float32",
               "--device", "cpu", "--batch_size", str(batch_size), "--tasks", tasks, "--include_path", str(TASKS),
               "--output_path", str(output), "--log_samples", "--seed", "1234"]
    return command + (["--limit", str(limit)] if limit else [])


def run_lm_eval(command: list[str], log_path: Path) -> float:
    """Runs lm_eval from the repository root (the tasks' data paths are relative to it), its output to the terminal
    and to log_path; returns its wall time in seconds. Raises if it fails."""
    if not LM_EVAL.exists():
        raise FileNotFoundError(f"{LM_EVAL} is missing: make eval-venv")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    started = time.monotonic()
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, cwd=PROJECT_ROOT, env=env, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True)
        for line in process.stdout:
            log.write(line)
            if line.startswith("|") or "error" in line.lower():
                print(line, end="", flush=True)
        code = process.wait(timeout=LM_EVAL_TIMEOUT_S)
    if code != 0:
        raise RuntimeError(f"lm_eval exited with {code}: see {log_path}")
    return time.monotonic() - started


def results(output: Path) -> dict:
    """lm_eval's newest results file under output (it writes output/<model>/results_<time>.json)."""
    found = sorted(output.rglob("results_*.json"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise FileNotFoundError(f"no lm_eval results under {output}")
    return json.loads(found[-1].read_text())


def samples(output: Path, task: str) -> list[dict]:
    """lm_eval's logged samples of one task (--log_samples), newest run."""
    found = sorted(output.rglob(f"samples_{task}_*.jsonl"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise FileNotFoundError(f"no lm_eval samples of {task} under {output}")
    return [json.loads(line) for line in found[-1].read_text().splitlines() if line]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, default=variant_dir(EXPORT_DIR, "int4"))
    parser.add_argument("--tasks", default="triton_arithmetic_mc")
    parser.add_argument("--limit", type=int, help="the first N documents of each task")
    parser.add_argument("--chat", action="store_true", help="local-chat-completions (generate_until tasks only)")
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--url", help="a running OpenAI API (http://HOST:PORT) instead of starting one")
    parser.add_argument("--concurrent", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=8, help="prompts per request")
    parser.add_argument("--output", type=Path, default=BUILD_DIR / "eval")
    args = parser.parse_args(argv)
    args.output.mkdir(parents=True, exist_ok=True)
    settings = json.loads((args.model_dir / "llm_settings.json").read_text())
    with ExitStack() as stack:
        url = args.url
        if url is None:
            ports = stack.enter_context(running_server(log_path=args.output / "server.log",
                                                       explicit_models=SERVED_MODELS,
                                                       env={MODEL_DIR_ENV: str(args.model_dir.resolve())}))
            url = stack.enter_context(running_openai_api(f"127.0.0.1:{ports.grpc}", args.model_dir,
                                                         args.output / "openai-api.log", log_level="warning"))
            if args.no_prefix_caching:
                reload_llm(f"127.0.0.1:{ports.http}", enable_kv_cache_reuse="false")
        command = lm_eval_command(url, settings["model_name"], args.model_dir, args.tasks, args.output,
                                  chat=args.chat, limit=args.limit, concurrent=args.concurrent,
                                  batch_size=args.batch_size)
        seconds = run_lm_eval(command, args.output / "lm_eval.log")
    print(f"\nlm_eval took {seconds:.1f} s against {args.model_dir} (its log: {args.output / 'lm_eval.log'}; "
          f"results and samples under {args.output})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
