"""Guided decoding's pieces without a model: guides checked and refused with messages that name the problem,
compiled once and cached (bounded), compiled off the caller's thread, and masks that touch only their own row."""

import json
import re
import threading

import numpy as np
import pytest

from python_backend.engine.batch_sampling import choose_next
from python_backend.engine.sampling import SamplingParams
from python_backend.engine.sequence import Sequence
from python_backend.errors import InvalidRequestError
from python_backend.guided import compiler as compiler_module
from python_backend.guided.compiler import GuideCompiler
from python_backend.guided.grammars import GuideSpec, grammar_text, guide_spec
from python_backend.guided.strict_schema import strict_schema

VOCAB = 49152


@pytest.fixture(scope="module")
def compiler(model_dir):
    return GuideCompiler.for_model(model_dir, (2,), VOCAB, cache_size=4)


@pytest.fixture(scope="module")
def texts(model_dir):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    return lambda ids: tokenizer.decode(ids)


@pytest.mark.parametrize("guide_type, guide, message", [
    ("jsn", "{}", "guided_decoding_guide_type must be one of json, json_schema"),
    (None, '{"type": "object"}', "guided_decoding_guide needs guided_decoding_guide_type"),
    ("json_schema", "", "guided_decoding_guide is empty"),
    ("ebnf_grammar", "  \n", "guided_decoding_guide is empty"),
    ("regex", "a" * 101, "guided_decoding_guide is 101 bytes, more than the limit of 100"),
])
def test_a_malformed_guide_request_is_refused_naming_it(guide_type, guide, message):
    with pytest.raises(InvalidRequestError, match=message):
        guide_spec(guide_type, guide, max_bytes=100)


def test_no_guide_is_none_and_json_needs_no_text():
    assert guide_spec(None, None, 100) is None and guide_spec("", "", 100) is None
    assert guide_spec("json", "", 100) == GuideSpec("json", "")


@pytest.mark.parametrize("guide_type, guide, message", [
    ("json_schema", '{"type": "objekt"}', "Invalid type: objekt"),
    ("json_schema", '{"type": "array", "uniqueItems": true}', 'Unimplemented keys: \\["uniqueItems"\\]'),
    ("json_schema", '{"type": ', "not valid JSON"),
    ("json_schema", '[1, 2]', "must be a JSON schema: an object"),
    ("regex", "[a-z", "unclosed character class"),
    ("ebnf_grammar", 'root ::= ( "yes" ', "not a valid GBNF grammar"),
    ("lark", "start: missing_rule", "missing_rule"),
])
def test_an_invalid_guide_is_refused_by_the_compiler_naming_the_problem(compiler, guide_type, guide, message):
    with pytest.raises(InvalidRequestError, match=message):
        compiler.compile(GuideSpec(guide_type, guide))


# --- json_schema guides are read strictly (XGrammar's strict_mode) ---

CITY_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"],
                                                                                      "default": "c"}},
               "required": ["city"]}


def allows(compiler, schema, text: str) -> bool:
    import llguidance

    matcher = llguidance.LLMatcher(compiler.tokenizer, grammar_text(GuideSpec("json_schema", json.dumps(schema))),
                                   log_level=0)
    return matcher.consume_tokens(compiler.tokenizer.tokenize_str(text)) and matcher.is_accepting()


def test_an_object_that_names_its_properties_allows_only_them(compiler):
    assert allows(compiler, CITY_SCHEMA, '{"city": "Oslo", "unit": "c"}') and allows(compiler, CITY_SCHEMA,
                                                                                     '{"city": "Oslo"}')
    assert not allows(compiler, CITY_SCHEMA, '{"city": "Oslo", "type": "string"}')
    nested = {"type": "array", "items": CITY_SCHEMA}
    assert not allows(compiler, nested, '[{"city": "Oslo", "x": 1}]') and allows(compiler, nested, '[{"city": "O"}]')


@pytest.mark.parametrize("opening", [{"additionalProperties": True}, {"additionalProperties": {"type": "integer"}},
                                     {"patternProperties": {"^x": {"type": "integer"}}}])
def test_a_schema_that_says_what_else_it_takes_keeps_it(compiler, opening):
    assert allows(compiler, {**CITY_SCHEMA, **opening}, '{"city": "Oslo", "x": 1}')


def test_an_object_naming_no_properties_stays_any_object(compiler):
    assert allows(compiler, {"type": "object"}, '{"anything": [1, 2]}')


def test_strictness_reaches_every_subschema_but_the_branches_of_an_all_of():
    closed = {**CITY_SCHEMA, "additionalProperties": False}
    schema = {"$defs": {"C": CITY_SCHEMA}, "anyOf": [{"$ref": "#/$defs/C"}, {"type": "array", "items": CITY_SCHEMA}],
              "properties": {"p": {"type": "object", "properties": {"q": {"prefixItems": [CITY_SCHEMA]}}}}}
    assert strict_schema(schema) == {
        "$defs": {"C": closed}, "anyOf": [{"$ref": "#/$defs/C"}, {"type": "array", "items": closed}],
        "properties": {"p": {"type": "object", "properties": {"q": {"prefixItems": [closed]}},
                             "additionalProperties": False}},
        "additionalProperties": False}
    merged = {"allOf": [CITY_SCHEMA, {"properties": {"zip": {"type": "string"}}}], "properties": {"x": {}}}
    assert strict_schema(merged) == merged, "closing allOf's branches would refuse each other's properties"
    assert strict_schema({"properties": {"enum": {"const": {"properties": {}}}}}) == {
        "properties": {"enum": {"const": {"properties": {}}}}, "additionalProperties": False}, "values are not schemas"


def test_compiled_guides_are_cached_by_their_text_and_the_cache_is_bounded(model_dir):
    compiler = GuideCompiler.for_model(model_dir, (2,), VOCAB, cache_size=2)
    specs = [GuideSpec("regex", f"[0-9]{{{n}}}") for n in (1, 2, 3)]
    compiler.compile(specs[0])
    compiler.compile(specs[0])
    assert (compiler.stats.compiled, compiler.stats.cache_hits) == (1, 1)
    compiler.compile(specs[1])
    compiler.compile(specs[0])  # used again: specs[1], compiled after it, is now the least recently used
    compiler.compile(specs[2])  # evicts specs[1]
    assert (compiler.stats.compiled, compiler.stats.cache_hits) == (3, 2)
    assert compiler.cached(specs[1]) is None
    assert compiler.cached(specs[0]) is not None and compiler.cached(specs[2]) is not None
    assert len(compiler._cache) == 2


def test_a_slow_compile_runs_on_the_compiler_thread_not_the_callers(model_dir, monkeypatch):
    compiler = GuideCompiler.for_model(model_dir, (2,), VOCAB)
    release, compiled_on = threading.Event(), []
    real = compiler_module.grammar_text

    def slow(spec):
        compiled_on.append(threading.current_thread().name)
        assert release.wait(30)
        return real(spec)

    monkeypatch.setattr(compiler_module, "grammar_text", slow)
    future = compiler.submit(GuideSpec("regex", "[a-c]+"))
    assert not future.done()  # submit returned while the compile waits
    release.set()
    assert future.result(timeout=30).matcher is not None
    assert compiled_on[0].startswith("guide-compiler")
    assert compiler.submit(GuideSpec("regex", "[a-c]+")).done()  # cached: ready at once
    compiler.close()


def sequence(guide=None, **params):
    seq = Sequence(prompt_ids=[1, 2, 3], params=SamplingParams(max_tokens=params.pop("max_tokens", 16),
                                                                end_ids=(2,), **params))
    seq.guide = guide
    return seq


def run(seqs, seed=0, steps=20):
    rng = np.random.default_rng(seed)
    failed = []
    for _ in range(steps):
        live = [s for s in seqs if not s.finished and s not in [f for f, _ in failed]]
        if not live:
            break
        logits = rng.normal(size=(len(seqs), VOCAB)).astype(np.float32)
        rows = [i for i, s in enumerate(seqs) if s in live]
        _, errors = choose_next(live, logits[rows])
        failed += errors
    return failed


def test_a_guided_row_takes_only_what_its_grammar_allows_and_ends_when_it_is_complete(compiler, texts):
    greedy = sequence(compiler.compile(GuideSpec("regex", "[0-9]{3}-[a-z]{2}")))
    sampled = sequence(compiler.compile(GuideSpec("regex", "[0-9]{3}-[a-z]{2}")), temperature=1.0, seed=5)
    assert run([greedy, sampled]) == []
    for seq in (greedy, sampled):
        text = texts(seq.output_ids)
        assert seq.finish_reason == "stop" and re.fullmatch("[0-9]{3}-[a-z]{2}", text), text


def test_a_guide_leaves_its_neighbours_choices_untouched(compiler):
    alone = [sequence(), sequence(temperature=0.7, seed=1)]
    run(alone, seed=3)
    guided = sequence(compiler.compile(GuideSpec("json_schema", json.dumps({"type": "object"}))))
    together = [sequence(), guided, sequence(temperature=0.7, seed=1)]
    rng = np.random.default_rng(3)
    for _ in range(16):  # the same logits rows as alone for the neighbours, a guided row between them
        rows = rng.normal(size=(2, VOCAB)).astype(np.float32)
        live = [s for s in together if not s.finished]
        logits = np.stack([rows[0], np.zeros(VOCAB, np.float32), rows[1]])[[together.index(s) for s in live]]
        choose_next(live, logits)
    assert [s.output_ids for s in (together[0], together[2])] == [s.output_ids for s in alone]
    assert guided.output_ids  # it ran too


def test_a_guide_at_a_dead_end_fails_its_own_row_only(compiler):
    dead = sequence(compiler.compile(GuideSpec("regex", "ab")))
    dead.guide.matcher.consume_token(int(1e9 % VOCAB))  # a token its grammar refuses: the matcher is in error
    neighbour = sequence()
    _, failed = choose_next([dead, neighbour], np.zeros((2, VOCAB), np.float32))
    assert [seq for seq, _ in failed] == [dead] and "allows no next token" in str(failed[0][1])
    assert neighbour.output_ids == [0]
