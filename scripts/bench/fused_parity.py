"""The fused graph with fp32 weights (no quantization), judged as the variants are: what moving fp32 onto the fused
graph and its slot cache (issue 34) starts from.

    python -m scripts.bench.fused_parity                       # the served export (build/model)
    python -m scripts.bench.fused_parity --source build/my-model

onnxruntime-genai's builder makes the graph from the export's Hugging Face folder (scripts/prepare/fused_graph.py, as
int4 and fast do), written to <source>-fused-fp32; then scripts/prepare/variant_parity.py's measures against fp32
PyTorch: last-position logits, and greedy agreement on the 42 load-test prompts over 64 tokens. The folder serves
as any variant's does (`make serve MODEL_DIR=build/model-fused-fp32`), from the slot cache with prefix caching.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import onnx

from python_backend.model_files import ONNX_FILE
from scripts.paths import EXPORT_DIR
from scripts.prepare import fused_graph, quantize, variant_parity


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", type=Path, default=EXPORT_DIR, help="the fp32 export (make model)")
    args = parser.parse_args(argv)
    output = args.source.with_name(args.source.name + "-fused-fp32")
    started = time.monotonic()
    model = fused_graph.build(quantize.source_weights(args.source))
    path = output / ONNX_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path), save_as_external_data=True, location=path.name + ".data")
    quantize.copy_model_files(args.source, output, quantize.Recipe("fp32-fused", graph="fused"))  # tokenizer, settings
    built = time.monotonic() - started
    measured = variant_parity.measure(args.source, output)
    greedy = measured["greedy_agreement"]
    print(json.dumps({"folder": str(output), "build_s": round(built, 1),
                      "model_mb": round(sum(p.stat().st_size for p in path.parent.iterdir()) / 1e6),
                      "max_abs_logit_diff": measured["max_abs_logit_diff"],
                      "greedy_identical": f"{greedy['identical']}/{greedy['prompts']} over {greedy['tokens']} tokens"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
