"""Speculative decoding in the engine (python_backend/engine/speculative.py), on the engine tests' tiny model
(tests/tiny_engine_model.py): fp32, the served default, checking the fast variant's drafts. A row decoding
alone gets plain decoding's tokens, in fewer calls of the served model; its stop sequence, penalty and
log-probabilities too; rows joining and leaving change nothing; a draft that fails costs nothing but the speed. And
the llm model's speculative_draft parameter finds its folder (beside the real model's folders)."""

from dataclasses import replace

import numpy as np
import pytest

from python_backend.engine.core import EngineCore
from python_backend.engine.sampling import SamplingParams
from python_backend.engine.scheduler import SchedulerConfig
from python_backend.engine.sequence import Sequence
from python_backend.engine.speculative import Drafter
from python_backend.model_files import ONNX_FILE, ModelSettings
from python_backend.runtime.factory import cpu_decoder
from python_backend.serving.llm_speculation import SpeculationSettings
from scripts.prepare.variant_parity import load_test_prompts
from tests.helpers import variant_folder

MAX_LEN, TOKENS, DRAFTS = 512, 24, 4
CONFIG = SchedulerConfig(max_batch_size=4, kv_budget_tokens=20_000, kv_layout="slots", max_context_length=MAX_LEN)


@pytest.fixture(scope="module")
def target(tiny_dir):
    return cpu_decoder(variant_folder(tiny_dir, "fp32") / ONNX_FILE)


@pytest.fixture(scope="module")
def draft(tiny_dir):
    return cpu_decoder(variant_folder(tiny_dir, "fast") / ONNX_FILE)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return [tokenizer.encode(p, apply_chat_template=True) for p in load_test_prompts()[:3]]


def sequence(prompt, **params) -> Sequence:
    return Sequence(prompt_ids=list(prompt), params=SamplingParams(**{"max_tokens": TOKENS, "end_ids": (2,),
                                                                     **params}))


def run(target, drafter, sequences, join_after: int = 0) -> EngineCore:
    """Runs the sequences to the end in one engine: the first alone, the others joining after join_after steps."""
    core = EngineCore(target, CONFIG, drafter=drafter)
    core.add(sequences[0])
    for _ in range(join_after):
        core.step()
    for seq in sequences[1:]:
        core.add(seq)
    while core.step().progressed:
        pass
    return core


def test_a_lone_greedy_row_gets_plain_decodings_tokens_in_fewer_calls(target, draft, prompts):
    drafter = Drafter(draft, DRAFTS, MAX_LEN)
    for prompt in prompts:
        plain, fast = sequence(prompt), sequence(prompt)
        run(target, None, [plain])
        core = run(target, drafter, [fast])
        assert (fast.output_ids, fast.finish_reason) == (plain.output_ids, plain.finish_reason)
        counts = core.speculation
        # each round gives its kept drafts and the served model's own token
        assert counts.rounds + counts.accepted >= len(fast.output_ids) - 1
        assert counts.rounds < len(fast.output_ids) // 2, f"drafts were seldom kept: {counts}"


def test_stop_sequences_penalties_and_log_probabilities_are_plain_decodings(target, draft, prompts):
    reference = sequence(prompts[0], repetition_penalty=1.2)
    run(target, None, [reference])
    stop = tuple(reference.output_ids[9:11])  # ends the answer inside a round of drafts
    params = {"repetition_penalty": 1.2, "stop_token_sequences": (stop,), "logprobs": True, "top_logprobs": 2}
    plain, fast = sequence(prompts[0], **params), sequence(prompts[0], **params)
    run(target, None, [plain])
    core = run(target, Drafter(draft, DRAFTS, MAX_LEN), [fast])
    assert core.speculation.rounds > 0
    assert (fast.output_ids, fast.finish_reason) == (plain.output_ids, plain.finish_reason)
    assert plain.finish_reason == "stop"
    assert [lp.top_ids for lp in fast.logprobs] == [lp.top_ids for lp in plain.logprobs]
    # the checking call computes the positions together: the same values but for float rounding
    np.testing.assert_allclose([lp.logprob for lp in fast.logprobs], [lp.logprob for lp in plain.logprobs],
                               atol=1e-4)


def test_rows_joining_and_leaving_a_speculating_row_keep_every_answer(target, draft, prompts):
    """The first row speculates alone, two rows join and decode plainly with it, the shorter ones leave, and the
    first speculates again, its draft cache carried on from where it stopped being the row's."""
    alone = [sequence(p, max_tokens=n) for p, n in zip(prompts, (40, 8, 12))]
    for seq in alone:
        run(target, None, [seq])
    together = [sequence(p, max_tokens=n) for p, n in zip(prompts, (40, 8, 12))]
    drafter = Drafter(draft, DRAFTS, MAX_LEN)
    core = run(target, drafter, together, join_after=3)
    assert [s.output_ids for s in together] == [s.output_ids for s in alone]
    assert core.speculation.rounds > 2  # before the others joined (2 rounds) and after they left


def test_a_lone_row_decodes_plainly_while_a_request_waits_and_speculates_once_none_does(target, draft, prompts):
    """A round of drafts (with the draft model's own prefill of the row) would hold back the prefill of requests
    waiting to join: the lone row speculates only when nothing waits."""
    one_prompt_a_step = replace(CONFIG, max_prefill_tokens=1)
    plain = [sequence(prompts[0], max_tokens=40), sequence(prompts[1], max_tokens=4)]
    for seq in plain:
        run(target, None, [seq])
    first, second = sequence(prompts[0], max_tokens=40), sequence(prompts[1], max_tokens=4)
    core = EngineCore(target, one_prompt_a_step, drafter=Drafter(draft, DRAFTS, MAX_LEN))
    core.add(first)
    core.add(second)
    core.step()  # the first is prefilled and decodes alone; the second waits for the next step's prefill budget
    assert [len(core.running), len(core.waiting)] == [1, 1]
    assert core.speculation.rounds == 0, "the lone row speculated while a request waited to join"
    while core.step().progressed:
        pass
    assert core.speculation.rounds > 0  # alone again once the second left, nothing waiting
    assert [first.output_ids, second.output_ids] == [s.output_ids for s in plain]


def test_a_groups_lone_row_speculates_while_the_next_group_waits(target, draft, prompts):
    """Dynamic batching: a request waiting cannot join the running group, so its lone row speculates anyway."""
    first, second = sequence(prompts[0], max_tokens=40), sequence(prompts[1], max_tokens=4)
    core = EngineCore(target, replace(CONFIG, strategy="dynamic"), drafter=Drafter(draft, DRAFTS, MAX_LEN))
    core.add(first)
    core.step()
    core.add(second)
    rounds = core.speculation.rounds
    core.step()
    assert [len(core.running), len(core.waiting)] == [1, 1] and core.speculation.rounds == rounds + 1


class FailingOnce:
    """The draft decoder, raising at its first call."""

    def __init__(self, inner):
        self.inner, self.failed = inner, False

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def forward_in_place(self, *args, **options):
        if not self.failed:
            self.failed = True
            raise RuntimeError("the draft model broke")
        return self.inner.forward_in_place(*args, **options)


def test_a_failing_draft_model_leaves_the_answer_to_plain_decoding(target, draft, prompts, capfd):
    plain, fast = sequence(prompts[1]), sequence(prompts[1])
    run(target, None, [plain])
    core = run(target, Drafter(FailingOnce(draft), DRAFTS, MAX_LEN), [fast])
    assert (fast.output_ids, fast.finish_reason) == (plain.output_ids, plain.finish_reason)
    assert core.speculation.rounds > 0  # the next step speculated again, its draft cache started anew
    assert "draft model failed, decoding plainly: RuntimeError: the draft model broke" in capfd.readouterr().err


def test_the_draft_parameter_names_a_variant_beside_the_served_folder(tmp_path, model_dir, capsys):
    fp32, fast = variant_folder(model_dir, "fp32"), variant_folder(model_dir, "fast")
    root = model_dir.parent.parent
    on = SpeculationSettings.from_parameters({"speculative_draft": "fast", "speculative_tokens": "6"})
    assert on.draft_dir(fp32, ModelSettings.load(fp32), root) == fast
    (tmp_path / "serve").symlink_to(fp32)  # docker/compose.yaml serves a link to the variant's folder
    assert on.draft_dir(tmp_path / "serve", ModelSettings.load(fp32), root) == fast
    assert on.draft_dir(fast, ModelSettings.load(fast), root) is None
    assert "the served folder is the draft model itself" in capsys.readouterr().err
    assert on.draft_dir(model_dir, ModelSettings.load(model_dir), root) is None  # build/model-fast beside it, but
    assert "the export's own graph" in capsys.readouterr().err  # its graph has a padded cache
    missing = SpeculationSettings.from_parameters({"speculative_draft": "int2"})
    assert missing.draft_dir(fp32, ModelSettings.load(fp32), root) is None
    assert "`make model QUANT=int2` builds a variant" in capsys.readouterr().err
    assert SpeculationSettings.from_parameters({}).draft_dir(fp32, ModelSettings.load(fp32), root) is None
    int4 = variant_folder(model_dir, "int4")
    pairs = SpeculationSettings.from_parameters({"speculative_draft": "fp32=fast, fp16 = fast"})
    assert pairs.draft_dir(fp32, ModelSettings.load(fp32), root) == fast
    assert pairs.draft_dir(int4, ModelSettings.load(int4), root) is None
    assert "names no draft for int4" in capsys.readouterr().err
    with pytest.raises(ValueError, match="served=draft pairs"):
        SpeculationSettings.from_parameters({"speculative_draft": "fp32=fast,int4"})
    with pytest.raises(ValueError, match="at least 1"):
        SpeculationSettings.from_parameters({"speculative_draft": "fast", "speculative_tokens": "0"})
