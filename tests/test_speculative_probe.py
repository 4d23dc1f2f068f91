"""scripts/bench/speculative_probe.py's two decoders, on the engine tests' tiny model (tests/tiny_engine_model.py):
fp32 checking the fast variant's drafts gives fp32's own greedy answer token for token, in fewer fp32 calls than
tokens."""

import pytest

from python_backend.model_files import ONNX_FILE
from python_backend.runtime.factory import cpu_decoder
from scripts.bench.speculative_probe import plain, speculative
from scripts.prepare.variant_parity import load_test_prompts
from tests.helpers import variant_folder

TOKENS, MAX_LEN = 20, 512


@pytest.fixture(scope="module")
def decoders(tiny_dir):
    return [cpu_decoder(variant_folder(tiny_dir, variant) / ONNX_FILE) for variant in ("fp32", "fast")]


def test_fp32_checking_drafts_gives_its_own_greedy_answer(decoders, tokenizer):
    target, draft = decoders
    prompt = tokenizer.encode(load_test_prompts()[0], apply_chat_template=True)
    answer, rounds = speculative(target, draft, prompt, TOKENS, 4, MAX_LEN)
    assert answer == plain(target, prompt, TOKENS, MAX_LEN)
    assert rounds < TOKENS // 2, "drafts were seldom kept"
