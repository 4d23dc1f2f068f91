"""Write perf_analyzer and genai-perf inputs from the load tests' prompt set.

    python -m loadtests.perf_inputs --output build/perf [--max-tokens choice:16,32,64,128] [--count 64]

- perf_analyzer_data.json, for `perf_analyzer --input-data`: {"data": [{"text_input": [...], "max_tokens": [...],
  "stream": [true]}, ...]}; one entry per request, used round robin; values are flat lists without the batch
  dimension (the ensemble's max_batch_size > 0), strings written as JSON strings.
- genai_perf_prompts.jsonl, for `genai-perf profile --input-file`: one {"text_input": "..."} per line (the key of
  genai-perf 0.0.7 in the 24.10 SDK container; later releases read "text" and still accept "text_input").
loadtests/run_perf_analyzer.sh runs both tools in NVIDIA's SDK container.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

from loadtests.workload import DEFAULT_PROMPTS, MaxTokens, load_prompts

PERF_ANALYZER_FILE = "perf_analyzer_data.json"
GENAI_PERF_FILE = "genai_perf_prompts.jsonl"


def perf_analyzer_data(prompts: list[str], max_tokens: MaxTokens, count: int, seed: int = 0) -> dict:
    rng = random.Random(seed)
    return {"data": [{"text_input": [prompts[i % len(prompts)]], "max_tokens": [max_tokens.sample(rng)],
                      "stream": [True]} for i in range(count)]}


def genai_perf_lines(prompts: list[str]) -> list[str]:
    return [json.dumps({"text_input": p}, ensure_ascii=False) for p in prompts]


_JSON_TYPES = {"BYTES": str, "INT32": int, "UINT64": int, "FP32": (int, float), "BOOL": bool}


def check_perf_analyzer_data(data: dict, inputs: list[dict]) -> None:
    """Checks the file against perf_analyzer's documented --input-data rules and the model's metadata inputs
    (name, datatype, shape with the batch dimension first); raises ValueError on the first problem."""
    by_name = {i["name"]: i for i in inputs}
    if not isinstance(data.get("data"), list) or not data["data"]:
        raise ValueError("perf_analyzer needs a non-empty 'data' list")
    for n, entry in enumerate(data["data"]):
        for name, values in entry.items():
            if name not in by_name:
                raise ValueError(f"entry {n}: '{name}' is not an input of the model")
            expected = by_name[name]
            if not isinstance(values, list):
                raise ValueError(f"entry {n}: '{name}' must be a flat list")
            per_item = 1
            for dim in expected["shape"][1:]:
                per_item *= dim if dim > 0 else len(values)
            if len(values) != per_item:
                raise ValueError(f"entry {n}: '{name}' has {len(values)} values, the model takes {per_item}")
            kind = _JSON_TYPES[expected["datatype"]]
            if not all(isinstance(v, kind) and not (kind is int and isinstance(v, bool)) for v in values):
                raise ValueError(f"entry {n}: '{name}' values must be {expected['datatype']}")
        missing = [i["name"] for i in inputs if i["name"] not in entry and not i.get("optional")]
        if missing:
            raise ValueError(f"entry {n}: missing required inputs {missing}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS)
    parser.add_argument("--max-tokens", default="choice:16,32,64,128")
    parser.add_argument("--count", type=int, default=64, help="perf_analyzer entries")
    parser.add_argument("--output", type=Path, default=Path("build/perf"))
    args = parser.parse_args(argv)
    prompts = load_prompts(args.prompts)
    args.output.mkdir(parents=True, exist_ok=True)
    data = perf_analyzer_data(prompts, MaxTokens.parse(args.max_tokens), args.count)
    (args.output / PERF_ANALYZER_FILE).write_text(json.dumps(data, ensure_ascii=False, indent=1))
    (args.output / GENAI_PERF_FILE).write_text("\n".join(genai_perf_lines(prompts)) + "\n", encoding="utf-8")
    print(f"wrote {args.output / PERF_ANALYZER_FILE} ({args.count} entries) and "
          f"{args.output / GENAI_PERF_FILE} ({len(prompts)} prompts)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
