"""Every weight variant (`make variants`: scripts/prepare/quantize.py) against its parity thresholds, and served once by a real
tritonserver from its own folder with no code change: the answer, the metrics' variant label, and for the variants
that keep fp32's greedy tokens, the same answer as fp32."""

from __future__ import annotations

import json

import pytest

from python_backend.model_files import MODEL_DIR_ENV, PARITY_REPORT_FILE, SETTINGS_FILE
from scripts.clients.llm_client import GenerateClient
from scripts.launcher.server_metrics import read_metrics
from scripts.launcher.triton_server import running_server
from scripts.prepare.quantize import QUANT_CHOICES, variant_dir
from scripts.prepare.variant_parity import THRESHOLDS, judge
from tests.helpers import wait_for

REQUEST = {"text_input": "What is the capital of France?", "max_tokens": 24, "apply_chat_template": True}


def report_of(model_dir, variant: str) -> dict:
    folder = variant_dir(model_dir, variant)
    if not (folder / PARITY_REPORT_FILE).is_file():
        pytest.fail(f"no {variant} variant at {folder}: run `make variants` (make test does)")
    return json.loads((folder / PARITY_REPORT_FILE).read_text())


@pytest.mark.parametrize("variant", QUANT_CHOICES)
def test_parity_report_within_the_variants_thresholds(model_dir, variant):
    report = report_of(model_dir, variant)
    assert report["variant"] == variant
    assert judge(variant, report)["passed"], (
        f"{variant}: max |Δ logits| {report['max_abs_logit_diff']:.3g}, greedy identical "
        f"{report['greedy_agreement']['identical_share']:.0%}; thresholds {THRESHOLDS[variant]}")


@pytest.fixture(scope="module")
def fp32_answer(server):
    return GenerateClient(f"127.0.0.1:{server.http}").complete(REQUEST)


@pytest.mark.server
@pytest.mark.parametrize("variant", [q for q in QUANT_CHOICES if q != "fp32"])
def test_each_variant_is_served_from_its_folder(model_dir, variant, fp32_answer, tmp_path):
    report_of(model_dir, variant)
    folder = variant_dir(model_dir, variant)
    assert json.loads((folder / SETTINGS_FILE).read_text())["quantization"] == variant
    with running_server(log_path=tmp_path / "server.log", env={MODEL_DIR_ENV: str(folder)}) as ports:
        answer = GenerateClient(f"127.0.0.1:{ports.http}").complete(REQUEST)

        # The engine counts a response's tokens after handing it to the server, so the counter can trail the answer.
        def counted() -> float:
            return read_metrics(f"127.0.0.1:{ports.metrics}", variant=variant).get("llm_output_tokens_total", 0)

        wait_for(lambda: counted() >= answer.output_tokens, 300, message="the variant's token counter")
        assert counted() == answer.output_tokens, "the model labelled with this variant generated the answer"
    assert answer.output_tokens > 0 and answer.text.strip()
    if THRESHOLDS[variant][1] >= 0.95:  # variants held to fp32's greedy tokens
        assert answer.text == fp32_answer.text and "Paris" in answer.text


@pytest.mark.server
def test_the_fp32_export_is_labelled_fp32(server, fp32_answer):
    assert read_metrics(f"127.0.0.1:{server.metrics}", variant="fp32")["llm_output_tokens_total"] > 0
