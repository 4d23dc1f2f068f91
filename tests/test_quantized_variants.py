"""Every weight variant (`make variants`: scripts/prepare/quantize.py) within its parity thresholds, measured now from
its folder's current weights through the current engine code, not read from the report the build wrote: max |Δ
logits| for every variant (the fast suite), greedy agreement beside each variant's served test; and served by the
session's shared tritonserver for that variant with no code change: the answer, the metrics' variant label, and for
the variants that keep fp32's greedy tokens, the same answer as fp32."""

from __future__ import annotations

import json

import numpy as np
import pytest

from python_backend.model_files import ONNX_FILE, SETTINGS_FILE
from python_backend.runtime.factory import cpu_decoder
from python_backend.runtime.onnx_slot_decoder import is_fused_graph
from scripts.clients.llm_client import GenerateClient
from scripts.launcher.server_metrics import read_metrics
from scripts.prepare.quantize import QUANT_CHOICES
from scripts.prepare import variant_parity
from scripts.prepare.variant_parity import (DECODE_STEPS_CHECKED, LOGIT_PROMPTS, THRESHOLDS, LogitReference, agreement,
                                            engine_greedy, load_reference_model, load_test_prompts,
                                            max_logit_difference, pytorch_greedy, pytorch_logits, reference_greedy)
from tests.helpers import variant_folder, wait_idle

REQUEST = {"text_input": "What is the capital of France?", "max_tokens": 24, "apply_chat_template": True}
# The build's parity check on all its logit prompts, and its greedy check on the first 12 of its 42 load-test prompts
# (the shortest): a few seconds a variant. Fewer would not do for fast, identical on 10 of 42: 3 of these 12, 1 of 8.
GREEDY_PROMPTS = slice(0, 12)


@pytest.fixture(scope="module")
def reference_model(settings):
    return load_reference_model(settings["hf_dir"])


@pytest.fixture(scope="module")
def logit_reference(reference_model, tokenizer) -> LogitReference:
    """What the build's logit check compares with, computed now with PyTorch (not read from the export's cache): fp32
    PyTorch's last-position logits for LOGIT_PROMPTS in one left-padded batch, at the prefill and at each of
    DECODE_STEPS_CHECKED steps fed its own greedy tokens."""
    prompts = [tokenizer.encode(p, apply_chat_template=True) for p in LOGIT_PROMPTS]
    return pytorch_logits(reference_model, prompts, DECODE_STEPS_CHECKED)


def test_the_exports_kept_references_are_pytorchs_now(model_dir, logit_reference, greedy_prompts):
    """The references the export keeps for the variants' checks (which then load no PyTorch model) are what PyTorch
    computes now: read back without a model to compute them with."""
    def no_model():
        raise AssertionError("the export's reference was not used")

    kept = variant_parity.logit_reference(model_dir, no_model, logit_reference.prompts, DECODE_STEPS_CHECKED)
    assert [list(t) for t in kept.fed] == [list(t) for t in logit_reference.fed]
    for kept_step, now in zip(kept.logits, logit_reference.logits, strict=True):
        # up to PyTorch's rounding with another thread count (3e-5 seen on logits near 25; the check allows 1e-3)
        np.testing.assert_allclose(kept_step, now, atol=1e-4, rtol=0)
    assert len(variant_parity.reference_greedy(model_dir, no_model, greedy_prompts)) == len(greedy_prompts)


@pytest.fixture(scope="module")
def greedy_prompts(tokenizer) -> list[list[int]]:
    return [tokenizer.encode(p, apply_chat_template=False) for p in load_test_prompts()]


@pytest.fixture(scope="module")
def greedy_reference(model_dir, reference_model, greedy_prompts) -> list[list[int]]:
    """fp32 PyTorch's greedy tokens for the load-test prompts (the export keeps them: computed only if missing)."""
    return reference_greedy(model_dir, lambda: reference_model, greedy_prompts)


@pytest.mark.parametrize("variant", QUANT_CHOICES)
def test_the_variants_current_logits_are_within_its_threshold(model_dir, variant, logit_reference):
    """The variant's weights as they are now, through the engine's KV cache, against fp32 PyTorch: max |Δ logits| on
    the build's logit prompts (prefill and decode steps), held to the build's threshold (a corrupted weight or a
    decoding change fails it; the report on disk is not read). About a second a variant."""
    decoder = cpu_decoder(variant_folder(model_dir, variant) / ONNX_FILE)
    max_diff, _ = max_logit_difference(decoder, logit_reference)
    assert max_diff <= THRESHOLDS[variant][0], f"{variant} now: max |Δ logits| {max_diff:.3g}; {THRESHOLDS[variant]}"


@pytest.mark.parametrize("variant", QUANT_CHOICES)
def test_every_variant_of_the_default_model_is_on_the_fused_graph_and_its_slot_cache(model_dir, variant):
    """One KV layout on the CPU: no variant falls back to the export's padded graph for the default model (which the
    fused graph takes whole)."""
    folder = variant_folder(model_dir, variant)
    assert json.loads((folder / SETTINGS_FILE).read_text())["graph"] == "fused"
    assert is_fused_graph(folder / ONNX_FILE)


def assert_greedy_agreement_now(model_dir, variant, greedy_prompts, greedy_reference):
    """Greedy agreement of the variant's current weights through the engine's greedy loop, on GREEDY_PROMPTS, held to
    the build's threshold (a few seconds a variant: beside the served test, out of the fast suite)."""
    decoder = cpu_decoder(variant_folder(model_dir, variant) / ONNX_FILE)
    answers = engine_greedy(decoder, greedy_prompts[GREEDY_PROMPTS])
    share = agreement(answers, greedy_reference[GREEDY_PROMPTS])["identical_share"]
    assert share >= THRESHOLDS[variant][1], (
        f"{variant} now: greedy identical {share:.0%} on {len(answers)} load-test prompts; {THRESHOLDS[variant]}")


def test_the_pytorch_reference_gives_each_prompt_in_a_padded_batch_its_tokens_alone(reference_model, kv_prompts):
    """The greedy reference every variant is judged by is computed in left-padded batches: prompts of three lengths
    together get the tokens each gets alone."""
    prompts = kv_prompts[:3]
    assert len({len(p) for p in prompts}) == 3
    alone = [pytorch_greedy(reference_model, [prompt], 4)[0] for prompt in prompts]
    assert pytorch_greedy(reference_model, prompts, 4) == alone


def test_a_reference_is_written_whole_and_a_failed_write_keeps_the_old_one(tmp_path, monkeypatch):
    """The variants, built side by side (make -j), read the reference files: one computed again is written to a file
    of its own and moved into place, never seen half-written; a write that fails leaves the old file and no other."""
    monkeypatch.setattr(variant_parity, "pytorch_greedy", lambda model, prompts, tokens: [[7, 8]] * len(prompts))
    assert variant_parity.reference_greedy(tmp_path, lambda: None, [[1, 2]]) == [[7, 8]]
    kept = (tmp_path / variant_parity.GREEDY_REFERENCE_FILE).read_text()
    with pytest.raises(OSError):
        with variant_parity._written_whole(tmp_path / variant_parity.GREEDY_REFERENCE_FILE) as partial:
            partial.write_text("half")
            raise OSError("disk full")
    assert [p.name for p in tmp_path.iterdir()] == [variant_parity.GREEDY_REFERENCE_FILE]
    assert (tmp_path / variant_parity.GREEDY_REFERENCE_FILE).read_text() == kept


@pytest.fixture(scope="module")
def fp32_answer(server):
    return GenerateClient(f"127.0.0.1:{server.http}").complete(REQUEST)


@pytest.mark.server
@pytest.mark.parametrize("variant", QUANT_CHOICES)
def test_each_variant_keeps_its_greedy_agreement_and_is_served_from_its_folder(model_dir, variant, variant_server,
                                                                              fp32_answer, greedy_prompts,
                                                                              greedy_reference):
    folder = variant_folder(model_dir, variant)
    assert json.loads((folder / SETTINGS_FILE).read_text())["quantization"] == variant
    assert_greedy_agreement_now(model_dir, variant, greedy_prompts, greedy_reference)
    ports = variant_server(variant)

    def counted() -> float:
        return read_metrics(f"127.0.0.1:{ports.metrics}", variant=variant).get("llm_output_tokens_total", 0)

    wait_idle(ports)  # the counters are complete once the engine is idle; other files' requests were counted before
    before = counted()
    answer = GenerateClient(f"127.0.0.1:{ports.http}").complete(REQUEST)
    wait_idle(ports)
    assert counted() - before == answer.output_tokens, "the model labelled with this variant generated the answer"
    assert answer.output_tokens > 0 and answer.text.strip()
    if THRESHOLDS[variant][1] >= 0.95:  # variants held to fp32's greedy tokens
        assert answer.text == fp32_answer.text and "Paris" in answer.text
