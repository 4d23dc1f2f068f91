"""llguidance against XGrammar on this project's tokenizer: what guided decoding's choice of library rests on.

    python -m scripts.bench.grammar_libraries
    # XGrammar is not a project dependency (it requires torch, transformers and OpenAI's triton); to compare it:
    pip install --no-deps --target /tmp/xgr xgrammar==0.2.9 apache-tvm-ffi && \\
        PYTHONPATH=/tmp/xgr python -m scripts.bench.grammar_libraries

Per library: tokenizer set-up, compile time of the held schema set (scripts/bench/structured_schemas.py; first
compile, and again without a cache), and the mask time per step while a matcher walks a valid answer, alone and 32
matchers at once, each mask written into a bitmask and applied to a numpy row of logits as the engine does."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from scripts.bench.structured_schemas import SCHEMAS
from scripts.paths import EXPORT_DIR

ANSWER_SCHEMA = SCHEMAS[4].schema  # "nested": objects in an object
ANSWER = '{"company": "Acme Corporation", "headquarters": {"city": "Lyon", "country": "France"}, ' \
         '"ceo": {"name": "Marie Curie", "since": 2019}}'


def timed(function, repeat: int = 1) -> float:
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        function()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1000


def apply(masks: np.ndarray, logits: np.ndarray) -> None:
    allowed = np.unpackbits(masks.view(np.uint8), axis=1, count=logits.shape[1], bitorder="little").view(np.bool_)
    logits[~allowed] = -np.inf


class Llguidance:
    name = "llguidance"

    def __init__(self, tokenizer_json: Path, vocab: int):
        import llguidance
        import llguidance.numpy

        from python_backend.guided.grammars import JSON_OPTIONS

        self.llg, self.np, self.options, self.vocab = llguidance, llguidance.numpy, JSON_OPTIONS, vocab
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json.read_text(), n_vocab=vocab, eos_token=2)
        self.executor = llguidance.LLExecutor()

    def compile(self, schema: dict):
        matcher = self.llg.LLMatcher(self.tokenizer, self.llg.LLMatcher.grammar_from_json_schema(
            schema, defaults=self.options))
        matcher.compute_bitmask()  # llguidance builds lazily: the first mask is part of the compile
        return matcher

    def matchers(self, compiled, n: int):
        return [compiled.deep_copy() for _ in range(n)]

    def masks(self, matchers, out: np.ndarray) -> None:
        self.np.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)], out)

    def accept(self, matcher, token: int) -> None:
        assert matcher.consume_token(token), matcher.get_error()

    def bitmask(self, n: int) -> np.ndarray:
        return self.np.allocate_token_bitmask(n, self.vocab)


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tokenizer_json: Path, vocab: int):
        import xgrammar
        from transformers import PreTrainedTokenizerFast

        self.xgr, self.vocab = xgrammar, vocab
        info = xgrammar.TokenizerInfo.from_huggingface(PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_json)),
                                                       vocab_size=vocab, stop_token_ids=[2])
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=2, cache_enabled=False)

    def compile(self, schema: dict):
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)

    def matchers(self, compiled, n: int):
        return [self.xgr.GrammarMatcher(compiled) for _ in range(n)]

    def masks(self, matchers, out) -> None:
        for i, matcher in enumerate(matchers):
            matcher.fill_next_token_bitmask(out, i)

    def accept(self, matcher, token: int) -> None:
        assert matcher.accept_token(token)

    def bitmask(self, n: int):
        return self.xgr.allocate_token_bitmask(n, self.vocab)


def measure(library_class, tokenizer_json: Path, vocab: int, answer_ids: list[int]) -> dict:
    setup = time.perf_counter()
    library = library_class(tokenizer_json, vocab)
    row = {"library": library.name, "tokenizer_setup_ms": (time.perf_counter() - setup) * 1000}
    row["compile_first_ms"] = statistics.median(timed(lambda s=case.schema: library.compile(s)) for case in SCHEMAS)
    row["compile_again_ms"] = statistics.median(timed(lambda s=case.schema: library.compile(s), 3) for case in SCHEMAS)
    compiled = library.compile(ANSWER_SCHEMA)
    for batch in (1, 32):
        matchers, out = library.matchers(compiled, batch), library.bitmask(batch)
        logits = np.zeros((batch, vocab), np.float32)
        steps = []
        for token in answer_ids:
            started = time.perf_counter()
            library.masks(matchers, out)
            apply(np.asarray(out), logits)
            steps.append(time.perf_counter() - started)
            for matcher in matchers:
                library.accept(matcher, token)
        row[f"mask_batch_{batch}_ms"] = statistics.median(steps) * 1000
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, default=EXPORT_DIR)
    args = parser.parse_args(argv)
    from tokenizers import Tokenizer

    tokenizer_json = args.model_dir / "tokenizer.json"
    tokenizer = Tokenizer.from_file(str(tokenizer_json))
    vocab, answer_ids = tokenizer.get_vocab_size(), tokenizer.encode(ANSWER, add_special_tokens=False).ids
    rows = []
    for library_class in (Llguidance, Xgrammar):
        try:
            rows.append(measure(library_class, tokenizer_json, vocab, answer_ids))
        except ImportError as error:
            print(f"{library_class.name}: not installed ({error}); see this script's docstring", file=sys.stderr)
    print(f"| library | tokenizer set-up (ms) | compile, first (ms) | compile, again (ms) | mask per step, 1 row "
          f"(ms) | mask per step, 32 rows (ms) |  ({len(SCHEMAS)} schemas; a {len(answer_ids)}-token answer)")
    print("| --- | --- | --- | --- | --- | --- |")
    for row in rows:
        print(f"| {row['library']} | {row['tokenizer_setup_ms']:.0f} | {row['compile_first_ms']:.2f} | "
              f"{row['compile_again_ms']:.2f} | {row['mask_batch_1_ms']:.3f} | {row['mask_batch_32_ms']:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
