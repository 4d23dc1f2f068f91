"""Guides compiled into llguidance matchers, once per guide text (a bounded LRU cache), off the engine's thread.

A compiled guide is a matcher in its start state whose first mask was already computed (llguidance builds its lexer
lazily, so that first mask is where a heavy schema costs): each request gets a deep copy of it, which takes
microseconds and shares what was built."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import llguidance

from python_backend.errors import InvalidRequestError
from python_backend.guided.grammars import GuideSpec, grammar_text
from python_backend.guided.guide import Guide


@dataclass
class CompileStats:
    compiled: int = 0  # guides compiled (cache misses that succeeded)
    cache_hits: int = 0
    rejected: int = 0  # guides refused as invalid
    compile_seconds: list[float] = field(default_factory=list)  # the last compile times, cold


class GuideCompiler:
    """Compiles guides for one tokenizer. ``compile`` runs on the caller's thread; ``submit`` on the compiler's own
    worker (a cached guide is ready at once, without the worker)."""

    def __init__(self, tokenizer_json: str | Path, eos_token_ids: tuple[int, ...], vocab_size: int,
                 cache_size: int = 256, workers: int = 1):
        tokenizer = Path(tokenizer_json).read_text(encoding="utf-8")
        self.tokenizer = llguidance.LLTokenizer(tokenizer, n_vocab=vocab_size, eos_token=list(eos_token_ids))
        self.vocab_size = vocab_size
        self.cache_size = cache_size
        self._cache: OrderedDict[tuple[str, str], llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="guide-compiler")
        self.stats = CompileStats()

    @classmethod
    def for_model(cls, model_dir: str | Path, eos_token_ids, vocab_size: int, **kwargs) -> GuideCompiler:
        return cls(Path(model_dir) / "tokenizer.json", tuple(eos_token_ids), vocab_size, **kwargs)

    def cached(self, spec: GuideSpec) -> Guide | None:
        with self._lock:
            template = self._cache.get(spec.cache_key)
            if template is None:
                return None
            self._cache.move_to_end(spec.cache_key)
            self.stats.cache_hits += 1
        return Guide(template.deep_copy(), self.vocab_size)

    def compile(self, spec: GuideSpec) -> Guide:
        """A fresh guide for one request; raises InvalidRequestError naming what is wrong with the guide."""
        guide = self.cached(spec)
        if guide is not None:
            return guide
        start = time.perf_counter()
        try:
            template = llguidance.LLMatcher(self.tokenizer, grammar_text(spec), log_level=0)
            if not template.is_error():
                template.compute_bitmask()  # builds the lexer's start states now, not on the engine's thread
            if template.is_error():
                raise InvalidRequestError(f"guided_decoding_guide ({spec.type}): {template.get_error()}")
        except InvalidRequestError:
            with self._lock:
                self.stats.rejected += 1
            raise
        with self._lock:
            self.stats.compiled += 1
            self.stats.compile_seconds = (self.stats.compile_seconds + [time.perf_counter() - start])[-1024:]
            self._cache[spec.cache_key] = template
            self._cache.move_to_end(spec.cache_key)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return Guide(template.deep_copy(), self.vocab_size)

    def submit(self, spec: GuideSpec) -> Future:
        """A future of compile(spec): done at once when the guide is cached."""
        guide = self.cached(spec)
        if guide is not None:
            done: Future = Future()
            done.set_result(guide)
            return done
        return self._pool.submit(self.compile, spec)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
