"""Engine metrics as Triton Python-backend custom metrics, served on Triton's metrics port (/metrics).

``pb_utils`` is passed in, so the module imports without a server."""

from __future__ import annotations

from python_backend.engine.loop import EngineObserver

LATENCY_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]
BATCH_BUCKETS = [1, 2, 4, 8, 16, 32, 64, 128]


class TritonMetricsObserver(EngineObserver):
    def __init__(self, pb_utils, labels: dict[str, str]):
        super().__init__()
        family = pb_utils.MetricFamily
        self._families = []  # a MetricFamily must outlive its Metric objects
        self._unreported_tokens = 0
        self._labels = labels
        # LoRA: tokens and finished requests per adapter, one labelled metric each, made when the adapter first runs
        self._adapter_families = (
            family(name="llm_lora_output_tokens_total", description="Tokens generated, per LoRA adapter",
                   kind=family.COUNTER),
            family(name="llm_lora_requests_total", description="Requests finished, per LoRA adapter",
                   kind=family.COUNTER))
        self._adapter_metrics: dict[str, tuple] = {}
        self._unreported_adapters: dict[str, list[int]] = {}  # adapter -> [tokens, requests], sent with the state

        def make(name, description, kind, buckets=None):
            metric_family = family(name=name, description=description, kind=kind)
            self._families.append(metric_family)
            if buckets is None:
                return metric_family.Metric(labels=labels)
            return metric_family.Metric(labels=labels, buckets=buckets)

        self.ttft = make("llm_time_to_first_token_seconds", "Time from arrival at the llm model to the first token",
                         family.HISTOGRAM, LATENCY_BUCKETS)
        self.itl = make("llm_inter_token_latency_seconds", "Time between two tokens of one sequence",
                        family.HISTOGRAM, LATENCY_BUCKETS)
        self.batch = make("llm_batch_size", "Sequences in each decode step", family.HISTOGRAM, BATCH_BUCKETS)
        self.tokens = make("llm_output_tokens_total", "Tokens generated", family.COUNTER)
        self.computed = make("llm_computed_tokens_total", "Token positions computed (prefill and decode)",
                             family.COUNTER)
        self.padding = make("llm_padding_tokens_total",
                            "Computed positions that were padding or finished rows", family.COUNTER)
        self.running = make("llm_running_sequences", "Sequences in the decode batch", family.GAUGE)
        self.waiting = make("llm_waiting_sequences", "Sequences waiting to be admitted", family.GAUGE)
        self.kv_bytes = make("llm_kv_cache_bytes", "Bytes held by the batch's KV cache", family.GAUGE)
        self.waste = make("llm_padding_waste_ratio", "padding tokens / computed tokens, since start", family.GAUGE)
        # Prefix caching (enable_kv_cache_reuse), counted in tokens as vLLM's prefix_cache_queries / _hits.
        self.prefix_queries = make("llm_prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache",
                                   family.COUNTER)
        self.prefix_hits = make("llm_prefix_cache_hits_total", "Prompt tokens found in the prefix cache",
                                family.COUNTER)
        self.prefix_evicted = make("llm_prefix_cache_evicted_blocks_total",
                                   "Prefix cache blocks dropped, least recently used first", family.COUNTER)
        self.prefix_bytes = make("llm_prefix_cache_bytes",
                                 "Bytes held by cached prompt prefixes (apart from llm_kv_cache_bytes)", family.GAUGE)
        # Speculative decoding (speculative_draft), as vLLM's spec_decode_num_draft_tokens / _num_accepted_tokens.
        self.draft_tokens = make("llm_spec_decode_draft_tokens_total",
                                 "Draft tokens the served model checked (speculative decoding)", family.COUNTER)
        self.accepted_tokens = make("llm_spec_decode_accepted_tokens_total",
                                    "Draft tokens kept: the tokens the served model chose", family.COUNTER)
        # The bounds, so that alerts can compare with them (queue near full, KV cache near its budget).
        self.max_queue = make("llm_max_queue_size", "Waiting sequences beyond this are refused", family.GAUGE)
        self.kv_budget = make("llm_kv_cache_budget_bytes",
                              "The most bytes llm_kv_cache_bytes may reach (the KV budget, padding included)",
                              family.GAUGE)

    def set_limits(self, max_queue_size: int, kv_budget_bytes: int) -> None:
        self.max_queue.set(max_queue_size)
        self.kv_budget.set(kv_budget_bytes)

    def on_prefill(self, computed: int, padding: int) -> None:
        super().on_prefill(computed, padding)
        self.computed.increment(computed)
        if padding:
            self.padding.increment(padding)

    def on_decode(self, batch_size: int, dead_rows: int) -> None:
        super().on_decode(batch_size, dead_rows)
        self.batch.observe(batch_size)
        self.computed.increment(batch_size)
        if dead_rows:
            self.padding.increment(dead_rows)

    def on_tokens(self, count: int, ttft: float | None, itl: float | None) -> None:
        self._unreported_tokens += count  # one increment per step: each metric call is a round trip to the server
        if ttft is not None:
            self.ttft.observe(ttft)
        if itl is not None:
            self.itl.observe(itl)

    def on_speculation(self, proposed: int, accepted: int) -> None:
        super().on_speculation(proposed, accepted)
        self.computed.increment(proposed)
        self.draft_tokens.increment(proposed)
        if accepted:
            self.accepted_tokens.increment(accepted)

    def on_prefix_lookup(self, queried: int, hits: int, evicted_blocks: int) -> None:
        self.prefix_queries.increment(queried)
        if hits:
            self.prefix_hits.increment(hits)
        if evicted_blocks:
            self.prefix_evicted.increment(evicted_blocks)

    def on_adapter_tokens(self, adapter: str, count: int, finished: bool) -> None:
        pending = self._unreported_adapters.setdefault(adapter, [0, 0])
        pending[0] += count
        pending[1] += finished

    def on_state(self, running: int, waiting: int, kv_bytes: int, prefix_cache_bytes: int = 0) -> None:
        if self._unreported_tokens:
            self.tokens.increment(self._unreported_tokens)
            self._unreported_tokens = 0
        for adapter, counts in self._unreported_adapters.items():
            if adapter not in self._adapter_metrics:
                self._adapter_metrics[adapter] = tuple(f.Metric(labels={**self._labels, "adapter": adapter})
                                                       for f in self._adapter_families)
            for metric, count in zip(self._adapter_metrics[adapter], counts):
                if count:
                    metric.increment(count)
        self._unreported_adapters.clear()
        self.running.set(running)
        self.waiting.set(waiting)
        self.kv_bytes.set(kv_bytes)
        self.prefix_bytes.set(prefix_cache_bytes)
        self.waste.set(self.padding_waste())
