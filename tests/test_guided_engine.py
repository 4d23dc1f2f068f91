"""Guided decoding in the engine on the real model (no server): every schema of the held set gives JSON that parses
and validates when its grammar ends the generation, greedy and sampled; a regular expression's and a GBNF grammar's
outputs match them; and a guided row leaves its neighbours' greedy tokens identical to their tokens alone."""

import json
import re

import jsonschema
import pytest

from python_backend.engine.core import EngineCore
from python_backend.engine.sampling import SamplingParams
from python_backend.engine.scheduler import SchedulerConfig
from python_backend.engine.sequence import Sequence
from python_backend.guided.compiler import GuideCompiler
from python_backend.guided.grammars import GuideSpec
from scripts.bench.structured_schemas import SCHEMAS, schema_prompt

CONFIG = SchedulerConfig(max_batch_size=32, kv_budget_tokens=200_000)
MAX_TOKENS = 160


@pytest.fixture(scope="module")
def compiler(model_dir, decoder, settings):
    return GuideCompiler.for_model(model_dir, tuple(settings["eos_token_ids"]), decoder.vocab_size)


def generate(decoder, prompts, guides, settings, max_tokens=MAX_TOKENS, **params):
    core = EngineCore(decoder, CONFIG)
    seqs = []
    for i, (prompt, guide) in enumerate(zip(prompts, guides)):
        seed = params.get("seed")
        seq = Sequence(prompt_ids=list(prompt), params=SamplingParams(
            max_tokens=max_tokens, end_ids=tuple(settings["eos_token_ids"]),
            **{**params, "seed": None if seed is None else seed + i}))
        seq.guide = guide
        core.add(seq)
        seqs.append(seq)
    while core.step().progressed:
        pass
    return seqs


@pytest.fixture(scope="module")
def schema_prompts(tokenizer):
    return [tokenizer.encode(schema_prompt(case), apply_chat_template=True) for case in SCHEMAS]


def check_held_set(cases, seqs, tokenizer):
    ended_by_grammar = 0
    for case, seq in zip(cases, seqs, strict=True):
        assert seq.finish_reason in ("stop", "length"), (case.name, seq.finish_reason)
        if seq.finish_reason == "stop":
            ended_by_grammar += 1
            jsonschema.validate(json.loads(tokenizer.decode(seq.output_ids)), case.schema)
    assert ended_by_grammar >= len(cases) - 2, f"only {ended_by_grammar} of {len(cases)} ended by the grammar"


# Sampled: every other schema of the held set, to keep the fast suite fast (the server test runs all of them).
@pytest.mark.parametrize("params, every", [({}, 1), ({"temperature": 0.8, "top_p": 0.95, "seed": 11}, 2)],
                         ids=["greedy", "sampled"])
def test_every_schema_of_the_held_set_validates(decoder, compiler, schema_prompts, tokenizer, settings, params, every):
    cases, prompts = SCHEMAS[::every], schema_prompts[::every]
    guides = [compiler.compile(GuideSpec("json_schema", json.dumps(case.schema))) for case in cases]
    check_held_set(cases, generate(decoder, prompts, guides, settings, **params), tokenizer)


def test_regex_and_gbnf_outputs_match_them(decoder, compiler, tokenizer, settings):
    prompts = [tokenizer.encode(q, apply_chat_template=True) for q in
               ("What is the phone number of the Louvre?", "Is Paris in France? Answer yes or no.")]
    phone = r"\+33 [1-9]( [0-9]{2}){4}"
    guides = [compiler.compile(GuideSpec("regex", phone)),
              compiler.compile(GuideSpec("ebnf_grammar", 'root ::= ("yes" | "no") ", because " [a-z ]{1,40} "."'))]
    seqs = generate(decoder, prompts, guides, settings)
    assert [s.finish_reason for s in seqs] == ["stop", "stop"]
    assert re.fullmatch(phone, tokenizer.decode(seqs[0].output_ids))
    assert re.fullmatch(r"(yes|no), because [a-z ]{1,40}\.", tokenizer.decode(seqs[1].output_ids))


def test_a_guided_row_leaves_its_neighbours_greedy_tokens_identical(decoder, compiler, schema_prompts, tokenizer,
                                                                    settings):
    neighbours = [tokenizer.encode(q, apply_chat_template=True) for q in
                  ("Name a primary color.", "What is the capital of France?")]
    alone = [generate(decoder, [p], [None], settings, max_tokens=24)[0].output_ids for p in neighbours]
    guide = compiler.compile(GuideSpec("json_schema", json.dumps(SCHEMAS[0].schema)))
    seqs = generate(decoder, [neighbours[0], schema_prompts[0], neighbours[1]], [None, guide, None], settings,
                    max_tokens=24)
    assert [seqs[0].output_ids, seqs[2].output_ids] == alone
    assert seqs[1].finish_reason == "stop"
