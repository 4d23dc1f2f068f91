"""Prefix caching on and off, one server build, one run (the llm parameter enable_kv_cache_reuse, switched by a reload).

    python -m scripts.bench.prefix_benchmark                       # QUANT=int4's folder; about 3 minutes here
    python -m scripts.bench.prefix_benchmark --model-dir build/model-fast

Three workloads, each run with reuse off, then on:
- shared: N streaming chat requests through the OpenAI API (the official client) behind one system prompt of ~530
  tokens, short user turns, C at a time, 32 greedy tokens each: time to first token p50/p95, the whole job's time;
- multi-turn: an 8-turn chat through the OpenAI API, each turn sent with the whole history so far: TTFT per turn;
- no shared prefix: the benchmark's 32-request workload (scripts/bench/workload.py) over gRPC at once: output tok/s.
The answers of each workload must be the same text with reuse on and off (greedy); the script says if not.
With llama.cpp's server built (`python -m scripts.bench.peers --build-only`), the shared workload also runs there on
the same prompt ids (the project's chat template), with `cache_prompt` off and on, beside this server's rows.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from python_backend.model_files import MODEL_DIR_ENV
from python_backend.serving.tokenization import PromptTokenizer
from scripts.bench import peers
from scripts.bench.workload import log, percentile, through_server, workload
from scripts.launcher.model_control import SERVED_MODELS, reload_llm
from scripts.launcher.openai_server import running_openai_api
from scripts.launcher.server_metrics import read_metrics
from scripts.launcher.triton_server import running_server
from scripts.paths import BUILD_DIR, EXPORT_DIR
from scripts.prepare.quantize import variant_dir

INSTRUCTION = (
    "You are the support assistant of a regional shipping company. Follow these rules for every answer. "
    "Answer in one or two short sentences. Name ports, carriers and document types exactly as the customer wrote "
    "them. Never invent tracking numbers, prices, dates or vessel names; if the question needs one of them, say that "
    "the customer should check the tracking page or call the office. Be polite and plain; avoid jargon unless the "
    "customer used it first. If a question is about customs, remind the customer that the broker files the "
    "declaration and that duties depend on the goods' classification. If a question is about dangerous goods, say "
    "that they need a declaration and may need special packaging, and that the office confirms what is allowed. "
    "If a question is about delays, apologise once and explain that weather, port congestion and inspections are the "
    "usual causes. If the customer is angry, stay calm and offer the office's phone line. Containers come in twenty "
    "and forty foot lengths; reefers keep goods cold; flat racks carry oversized cargo. A bill of lading is the "
    "contract of carriage and the receipt for the goods; a sea waybill is not a document of title. Incoterms say who "
    "pays for what part of the trip. Our offices are open on weekdays from eight to six. We do not ship live animals. "
) * 2
QUESTIONS = ["Where is Rotterdam?", "What is a bill of lading?", "Can you ship a piano?", "What does TEU mean?",
             "Is my reefer cold enough?", "Why is my container late?", "Do you ship cats?", "Who pays the duties?"]
TURNS = ["Hello, I have a question about a shipment.", "It is a forty foot container to Hamburg.",
         "It holds machine parts.", "Do I need a customs broker?", "Who files the declaration?",
         "How long does the trip take?", "What if it is late?", "Thank you, that is all."]


def shared_conversations(n: int) -> list[list[dict]]:
    return [[{"role": "system", "content": INSTRUCTION},
             {"role": "user", "content": f"{QUESTIONS[i % len(QUESTIONS)]} (ticket {i})"}] for i in range(n)]


def openai_chat(client, model: str, messages: list[dict], max_tokens: int) -> tuple[str, float]:
    """One streaming greedy chat completion: its text and the time to its first content delta."""
    started, first, parts = time.perf_counter(), None, []
    for chunk in client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                                temperature=0, stream=True):
        delta = chunk.choices[0].delta.content if chunk.choices else None
        if delta:
            first = first if first is not None else time.perf_counter() - started
            parts.append(delta)
    return "".join(parts), first if first is not None else time.perf_counter() - started


def timed_concurrently(call, items: list, concurrency: int) -> dict:
    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(call, items))
    wall = time.perf_counter() - started
    ttft = [t for _, t in results]
    return {"wall_s": wall, "ttft_p50": percentile(ttft, 50), "ttft_p95": percentile(ttft, 95),
            "texts": [text for text, _ in results]}


def run_multi_turn(client, model: str) -> dict:
    messages, ttfts, texts = [{"role": "system", "content": INSTRUCTION}], [], []
    for turn in TURNS:
        messages.append({"role": "user", "content": turn})
        text, ttft = openai_chat(client, model, messages, 24)
        messages.append({"role": "assistant", "content": text})
        ttfts.append(ttft)
        texts.append(text)
    return {"ttft_per_turn": ttfts, "texts": texts}


def run_unshared(grpc: str) -> dict:
    results, wall = through_server(workload(32), grpc, concurrent=True)
    return {"tokens_per_s": sum(r.output_tokens for r in results) / wall, "texts": [r.text for r in results]}


def measure(ports, api_url: str, conversations: list[list[dict]], concurrency: int) -> dict:
    from openai import OpenAI

    grpc = f"127.0.0.1:{ports.grpc}"
    through_server(workload(2), grpc, concurrent=True)  # warm-up
    client = OpenAI(base_url=f"{api_url}/v1", api_key="unused", max_retries=0, timeout=600)
    model = client.models.list().data[0].id
    out = {"shared": timed_concurrently(lambda messages: openai_chat(client, model, messages, 32), conversations,
                                        concurrency),
           "multi_turn": run_multi_turn(client, model), "unshared": run_unshared(grpc)}
    values = read_metrics(f"127.0.0.1:{ports.metrics}", model="llm")
    out["queried"] = values.get("llm_prefix_cache_queries_total", 0)
    out["hits"] = values.get("llm_prefix_cache_hits_total", 0)
    return out


def llama_rows(model_dir: Path, conversations: list[list[dict]], concurrency: int) -> dict:
    """llama.cpp's server on the shared workload's prompt ids, cache_prompt off then on (empty if not built)."""
    if not peers.llama_built():
        log("llama.cpp's server is not built: skipped (`python -m scripts.bench.peers --build-only`)")
        return {}
    tokenizer = PromptTokenizer(model_dir)
    prompts = [tokenizer.encode_conversation(messages) for messages in conversations]
    rows = {}
    context = concurrency * (max(len(p) for p in prompts) + 64)  # llama-server splits -c among its slots
    with peers.llama_server(slots=concurrency, context=context) as url:
        for cache_prompt in (False, True):
            def call(prompt, cache_prompt=cache_prompt):
                answer = peers.llama_complete(url, prompt, 32, cache_prompt=cache_prompt)
                return answer.text, answer.first_token_s
            rows[f"cache_prompt {'on' if cache_prompt else 'off'}"] = timed_concurrently(call, prompts, concurrency)
    return rows


def table(off: dict, on: dict, n: int, concurrency: int) -> str:
    s_off, s_on = off["shared"], on["shared"]
    m_off, m_on = off["multi_turn"]["ttft_per_turn"], on["multi_turn"]["ttft_per_turn"]
    lines = ["| workload | reuse off | reuse on | on / off |", "| --- | --- | --- | --- |",
             f"| shared instruction, {n} requests, {concurrency} at a time: TTFT p50 (s) | {s_off['ttft_p50']:.2f} | "
             f"{s_on['ttft_p50']:.2f} | x{s_off['ttft_p50'] / s_on['ttft_p50']:.1f} lower |",
             f"| the same: TTFT p95 (s) | {s_off['ttft_p95']:.2f} | {s_on['ttft_p95']:.2f} | "
             f"x{s_off['ttft_p95'] / s_on['ttft_p95']:.1f} lower |",
             f"| the same: whole job (s) | {s_off['wall_s']:.1f} | {s_on['wall_s']:.1f} | "
             f"x{s_off['wall_s'] / s_on['wall_s']:.1f} faster |",
             f"| multi-turn: TTFT of turn 1 / turn 8 (s) | {m_off[0]:.2f} / {m_off[-1]:.2f} | "
             f"{m_on[0]:.2f} / {m_on[-1]:.2f} | turn 8 at x{m_on[-1] / m_on[0]:.2f} of turn 1 with reuse |",
             f"| no shared prefix, 32 at once: output tok/s | {off['unshared']['tokens_per_s']:.1f} | "
             f"{on['unshared']['tokens_per_s']:.1f} | "
             f"x{on['unshared']['tokens_per_s'] / off['unshared']['tokens_per_s']:.2f} |",
             f"| prompt tokens looked up / found in the cache | {off['queried']:.0f} / {off['hits']:.0f} | "
             f"{on['queried']:.0f} / {on['hits']:.0f} | hit rate {on['hits'] / max(on['queried'], 1):.0%} |"]
    for name, row in on.get("llama", {}).items():
        lines.append(f"| llama.cpp's server, {name}: shared, TTFT p50 / p95 (s), whole job (s) | | "
                     f"{row['ttft_p50']:.2f} / {row['ttft_p95']:.2f}, {row['wall_s']:.1f} | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, default=variant_dir(EXPORT_DIR, "int4"))
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--output", type=Path, default=BUILD_DIR / "benchmark-prefix.json")
    args = parser.parse_args(argv)
    conversations = shared_conversations(args.requests)
    model_dir = args.model_dir.resolve()
    with running_server(log_path=BUILD_DIR / "benchmark-prefix-server.log", explicit_models=SERVED_MODELS,
                        env={MODEL_DIR_ENV: str(model_dir)}) as ports, \
            running_openai_api(f"127.0.0.1:{ports.grpc}", model_dir, BUILD_DIR / "benchmark-prefix-openai.log") as api:
        http = f"127.0.0.1:{ports.http}"
        reload_llm(http, enable_kv_cache_reuse="false")
        log("prefix caching off")
        off = measure(ports, api, conversations, args.concurrency)
        reload_llm(http, enable_kv_cache_reuse="true")  # a new model instance: its counters start at zero
        log("prefix caching on")
        on = measure(ports, api, conversations, args.concurrency)
    on["llama"] = llama_rows(model_dir, conversations, args.concurrency)
    for name in ("shared", "multi_turn", "unshared"):
        if off[name]["texts"] != on[name]["texts"]:
            log(f"WARNING: {name}: the answers differ with reuse on")
    print(table(off, on, args.requests, args.concurrency))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"off": off, "on": on}, indent=2))
    log(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
