"""lm-eval, unchanged (its own venv: `make eval-venv`), against the real server's OpenAI API on the fp32 export:
`local-completions` on a multiple-choice task (each choice's log-likelihood within 1e-3 of transformers' on the same
weights), on perplexity (loglikelihood_rolling) and on free generation; `local-chat-completions` on free generation.
The tasks are the repository's own (scripts/eval/tasks/): nothing is downloaded."""

from __future__ import annotations

import pytest
import torch

from scripts.eval.run import LM_EVAL, lm_eval_command, results, run_lm_eval, samples

pytestmark = [pytest.mark.server,
              pytest.mark.skipif(not LM_EVAL.exists(), reason=f"{LM_EVAL} is missing: make eval-venv")]


def transformers_loglikelihood(hf_model, tokenizer, context: str, continuation: str) -> float:
    """The continuation's log-likelihood after the context, tokenized as lm-eval does (the whole, then split)."""
    encode = tokenizer.tokenizer
    whole = encode(context + continuation, add_special_tokens=False).input_ids
    context_ids = encode(context, add_special_tokens=False).input_ids
    with torch.no_grad():
        logits = hf_model(torch.tensor([whole])).logits[0].double()
    log_probs = torch.log_softmax(logits, -1)
    return sum(log_probs[i - 1, whole[i]].item() for i in range(len(context_ids), len(whole)))


@pytest.fixture(scope="module")
def completions_run(service, model, model_dir, tmp_path_factory):
    output = tmp_path_factory.mktemp("lm-eval")
    tasks = "triton_arithmetic_mc,triton_passages_ppl,triton_arithmetic_gen"
    run_lm_eval(lm_eval_command(f"http://127.0.0.1:{service}", model, model_dir, tasks, output, limit=4),
                output / "lm_eval.log")
    return output


def test_multiple_choice_log_likelihoods_equal_transformers(completions_run, hf_model, tokenizer):
    found = samples(completions_run, "triton_arithmetic_mc")
    assert len(found) == 4
    for sample in found:
        assert len(sample["resps"]) == 4  # one request per choice
        for arguments, [response] in zip(sample["arguments"].values(), sample["resps"]):
            context, continuation = arguments["arg_0"], arguments["arg_1"]
            served = float(response[0])
            expected = transformers_loglikelihood(hf_model, tokenizer, context, continuation)
            assert served == pytest.approx(expected, abs=1e-3), (context[-40:], continuation)
    accuracy = results(completions_run)["results"]["triton_arithmetic_mc"]["acc,none"]
    assert 0 <= accuracy <= 1


def test_perplexity_and_generation_tasks_complete(completions_run):
    scores = results(completions_run)["results"]
    assert 1 < scores["triton_passages_ppl"]["word_perplexity,none"] < 1000
    assert "exact_match,strip" in scores["triton_arithmetic_gen"]
    generated = samples(completions_run, "triton_arithmetic_gen")
    assert len(generated) == 4 and all(isinstance(s["resps"][0][0], str) for s in generated)


def test_chat_completions_generate(service, model, model_dir, tmp_path):
    run_lm_eval(lm_eval_command(f"http://127.0.0.1:{service}", model, model_dir, "triton_arithmetic_gen", tmp_path,
                                chat=True, limit=2), tmp_path / "lm_eval.log")
    generated = samples(tmp_path, "triton_arithmetic_gen")
    assert len(generated) == 2 and all(s["resps"][0][0] for s in generated)
