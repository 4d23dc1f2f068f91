"""An evaluation job's wall time: lm-eval's multiple-choice task (scripts/eval/tasks/arithmetic_mc.yaml: 200 questions x
4 choices behind one shared few-shot prefix, 800 loglikelihood requests) through this server's OpenAI API with prefix
caching on and off, against lm-eval's own `hf` backend on the same weights on the same CPU, one after the other:

    python -m scripts.bench.eval_benchmark                       # the default variant (int4)
    python -m scripts.bench.eval_benchmark --hf-batch-sizes 8,32 --limit 50

The hf backend runs at each of --hf-batch-sizes on the first --probe questions and then in full at the fastest ("its
best batch size"). Prints one table: wall time, accuracy, and per choice the largest |Δ log-likelihood| from the hf
backend's (the default variant's 4-bit weights against the fp32 weights the hf backend loads: its parity report
gives the bound); lm-eval's results stay under --output.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from python_backend.model_files import MODEL_DIR_ENV
from scripts.bench.workload import log
from scripts.eval.run import hf_command, lm_eval_command, results, run_lm_eval, samples
from scripts.launcher.model_control import SERVED_MODELS, reload_llm
from scripts.launcher.openai_server import running_openai_api
from scripts.launcher.triton_server import running_server
from scripts.paths import BUILD_DIR, EXPORT_DIR
from scripts.prepare.quantize import variant_dir

TASK = "triton_arithmetic_mc"


def loglikelihoods(output: Path) -> dict[tuple[int, int], float]:
    """(document, choice) -> the log-likelihood lm-eval logged."""
    found = {}
    for sample in samples(output, TASK):
        for choice, [response] in enumerate(sample["resps"]):  # [log-likelihood, is_greedy], as strings
            found[(sample["doc_id"], choice)] = float(response[0])
    return found


def run(name: str, command: list[str], output: Path) -> dict:
    output.mkdir(parents=True, exist_ok=True)
    log(f"{name}: lm_eval")
    seconds = run_lm_eval(command, output / "lm_eval.log")
    accuracy = results(output)["results"][TASK]["acc,none"]
    log(f"{name}: {seconds:.1f} s, accuracy {accuracy:.3f}")
    return {"name": name, "seconds": seconds, "accuracy": accuracy, "loglikelihoods": loglikelihoods(output)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, default=variant_dir(EXPORT_DIR, "int4"))
    parser.add_argument("--limit", type=int, help="the first N questions (default: all 200)")
    parser.add_argument("--hf-batch-sizes", default="8,32")
    parser.add_argument("--probe", type=int, default=24, help="questions each hf batch size is tried on")
    parser.add_argument("--concurrent", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=8, help="prompts per request to the server")
    parser.add_argument("--output", type=Path, default=BUILD_DIR / "eval-benchmark")
    args = parser.parse_args(argv)
    settings = json.loads((args.model_dir / "llm_settings.json").read_text())
    args.output.mkdir(parents=True, exist_ok=True)
    rows = []
    with running_server(log_path=args.output / "server.log", explicit_models=SERVED_MODELS,
                        env={MODEL_DIR_ENV: str(args.model_dir.resolve())}) as ports, \
            running_openai_api(f"127.0.0.1:{ports.grpc}", args.model_dir, args.output / "openai-api.log",
                               log_level="warning") as url:
        for reuse in ("true", "false"):
            reload_llm(f"127.0.0.1:{ports.http}", enable_kv_cache_reuse=reuse)  # a fresh engine: nothing cached
            output = args.output / f"server-reuse-{reuse}"
            rows.append(run(f"server, prefix caching {'on' if reuse == 'true' else 'off'}",
                            lm_eval_command(url, settings["model_name"], args.model_dir, TASK, output,
                                            limit=args.limit, concurrent=args.concurrent,
                                            batch_size=args.batch_size), output))
    hf_dir = Path(settings["hf_dir"])
    probes = {}
    for size in (int(s) for s in args.hf_batch_sizes.split(",")):
        output = args.output / f"hf-probe-{size}"
        output.mkdir(parents=True, exist_ok=True)
        probes[size] = run_lm_eval(hf_command(hf_dir, TASK, output, size, limit=args.probe), output / "lm_eval.log")
        log(f"hf backend, batch size {size}: {probes[size]:.1f} s on {args.probe} questions")
    best = min(probes, key=probes.get)
    rows.append(run(f"lm-eval hf backend, batch size {best}", hf_command(hf_dir, TASK, args.output / "hf", best,
                                                                        limit=args.limit), args.output / "hf"))
    reference = rows[-1]["loglikelihoods"]
    print(f"\n{TASK}: {len(reference) // 4} questions x 4 choices, {args.model_dir.name} served, "
          f"hf backend on {hf_dir} (fp32)")
    print("| run | wall time (s) | × hf backend | accuracy | max |Δ log-likelihood| from hf |")
    print("| --- | --- | --- | --- | --- |")
    for row in rows:
        delta = max(abs(row["loglikelihoods"][k] - reference[k]) for k in reference)
        print(f"| {row['name']} | {row['seconds']:.1f} | {rows[-1]['seconds'] / row['seconds']:.2f} | "
              f"{row['accuracy']:.3f} | {delta:.2e} |")
    print(f"(hf batch sizes tried on {args.probe} questions: "
          + ", ".join(f"{s}: {t:.1f} s" for s, t in probes.items()) + ")")
    summary = [{k: v for k, v in row.items() if k != "loglikelihoods"} for row in rows]
    (args.output / "results.json").write_text(json.dumps({"rows": summary, "hf_probes": probes}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
