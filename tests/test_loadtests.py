"""Load-test tooling: the workload, the perf_analyzer / genai-perf inputs (checked against the running server's
own metadata), and the --quick sweep end to end against a real server."""

from __future__ import annotations

import csv
import json
import random
import subprocess
import sys

import pytest
import tritonclient.http as httpclient

from loadtests.perf_inputs import (GENAI_PERF_FILE, PERF_ANALYZER_FILE, check_perf_analyzer_data,
                                   genai_perf_lines, main as perf_inputs_main)
from loadtests.workload import MaxTokens, Workload, load_prompts
from scripts.triton_server import PROJECT_ROOT


def test_max_tokens_distributions():
    rng = random.Random(0)
    assert {MaxTokens.parse("choice:16,32").sample(rng) for _ in range(100)} == {16, 32}
    assert all(16 <= MaxTokens.parse("uniform:16:20").sample(rng) <= 20 for _ in range(100))
    assert MaxTokens.parse("fixed:64").sample(rng) == 64
    for bad in ("choice:", "uniform:5", "gauss:1,2", "fixed:0", "choice:a"):
        with pytest.raises(ValueError, match="bad max_tokens distribution"):
            MaxTokens.parse(bad)


def test_the_latency_throughput_curve_is_the_pareto_front():
    from dataclasses import replace

    from loadtests.sweep import Cell, pareto_front

    base = Cell("continuous", 1, 1, 6, 10, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, "")
    cells = [replace(base, max_batch_size=b, output_tokens_per_s=tps, latency_p95_s=p95)
             for b, tps, p95 in [(1, 40, 1.5), (2, 60, 6.0), (4, 80, 4.0), (8, 80, 5.0), (16, 120, 9.0), (32, 100, 12)]]
    # (2: slower and later than 4), (8: as fast as 4 but later), (32: slower and later than 16) are dominated
    assert [c.max_batch_size for c in pareto_front(cells)] == [1, 4, 16]


def test_the_shipped_prompt_set_mixes_lengths_and_languages():
    rows = [json.loads(line) for line in (PROJECT_ROOT / "loadtests" / "prompts.jsonl").read_text().splitlines()]
    assert len(rows) >= 40 and {"en", "zh", "code", "emoji"} <= {r["lang"] for r in rows}
    lengths = [r["prompt_tokens"] for r in rows]
    assert min(lengths) <= 6 and max(lengths) >= 60
    request = Workload(load_prompts(), MaxTokens.parse("fixed:8"), seed=1).next_request()
    assert request["max_tokens"] == 8 and request["text_input"]


def test_perf_inputs_follow_the_documented_formats_and_the_served_model(server, tmp_path):
    assert perf_inputs_main(["--output", str(tmp_path), "--count", "16"]) == 0
    data = json.loads((tmp_path / PERF_ANALYZER_FILE).read_text())
    metadata = httpclient.InferenceServerClient(f"127.0.0.1:{server.http}").get_model_metadata("ensemble")
    config = httpclient.InferenceServerClient(f"127.0.0.1:{server.http}").get_model_config("ensemble")
    optional = {i["name"] for i in config["input"] if i.get("optional")}
    inputs = [{**i, "optional": i["name"] in optional} for i in metadata["inputs"]]
    check_perf_analyzer_data(data, inputs)
    assert len(data["data"]) == 16 and all(e["stream"] == [True] for e in data["data"])
    with pytest.raises(ValueError, match="'prompt' is not an input"):
        check_perf_analyzer_data({"data": [{"prompt": ["x"]}]}, inputs)
    with pytest.raises(ValueError, match="missing required inputs"):
        check_perf_analyzer_data({"data": [{"text_input": ["x"]}]}, inputs)
    with pytest.raises(ValueError, match="must be INT32"):
        check_perf_analyzer_data({"data": [{"text_input": ["x"], "max_tokens": ["8"]}]}, inputs)
    lines = (tmp_path / GENAI_PERF_FILE).read_text().splitlines()
    assert lines == genai_perf_lines(load_prompts())
    assert all(list(json.loads(line)) == ["text_input"] for line in lines)


@pytest.fixture(scope="module")
def quick_sweep(tmp_path_factory, model_dir):
    output = tmp_path_factory.mktemp("sweep")
    result = subprocess.run([sys.executable, "-m", "loadtests.sweep", "--quick", "--output", str(output)],
                            cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=600,
                            env={**__import__("os").environ, "TRITON_LLM_MODEL_DIR": str(model_dir)})
    assert result.returncode == 0, result.stderr[-3000:]
    return output


def test_quick_sweep_writes_sane_results_plots_and_report(quick_sweep):
    cells = json.loads((quick_sweep / "results.json").read_text())
    assert len(cells) == 4 and {c["strategy"] for c in cells} == {"continuous", "static"}
    with open(quick_sweep / "results.csv") as handle:
        assert len(list(csv.DictReader(handle))) == 4
    for cell in cells:
        assert cell["requests"] > 0 and cell["requests_per_s"] > 0 and cell["output_tokens_per_s"] > 0, cell
        assert 0 < cell["latency_p50_s"] <= cell["latency_p95_s"] <= cell["latency_p99_s"], cell
        assert 0 < cell["ttft_p50_s"] <= cell["ttft_p95_s"], cell
        assert cell["itl_p50_s"] > 0 and cell["engine_mean_batch_size"] >= 1, cell
        # the numbers are Locust's own
        with open(quick_sweep / cell["locust_csv"]) as handle:
            rows = {r["Name"]: r for r in csv.DictReader(handle)}
        main = rows["generate_stream"]
        assert cell["requests"] == int(main["Request Count"])
        assert cell["requests_per_s"] == float(main["Requests/s"])
        assert cell["latency_p95_s"] == float(main["95%"]) / 1000
        assert cell["latency_p99_s"] == float(main["99%"]) / 1000
        assert cell["ttft_p50_s"] == float(rows["generate_stream TTFT"]["50%"]) / 1000
    for name in ("latency_vs_batch_size.png", "throughput_vs_batch_size.png", "latency_throughput.png"):
        content = (quick_sweep / name).read_bytes()
        assert content[:8] == b"\x89PNG\r\n\x1a\n" and len(content) > 10_000, name
    report = (quick_sweep / "report.md").read_text()
    assert "| continuous | 8 | 8 |" in report and ("Best within the budget" in report or "No cell meets" in report)
    # with 8 users in flight, the engine batches them when allowed to, and cannot when max_batch_size is 1
    by = {(c["strategy"], c["max_batch_size"]): c for c in cells}
    assert by[("continuous", 1)]["engine_mean_batch_size"] == 1
    assert by[("continuous", 8)]["engine_mean_batch_size"] > 2
