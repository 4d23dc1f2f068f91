"""Models other than the default, end to end. A tiny randomly initialised Llama whose tokenizer adds a BOS token and
has no chat template, exported by `scripts.prepare.export_onnx` and served by a real tritonserver: raw prompts must
reach the model with the BOS, whether or not the request asks for the (missing) chat template. A tiny random Gemma 2
(soft-capped attention, a sliding window, a final soft cap): exported exactly and served token-exact."""

from __future__ import annotations

import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import torch

from python_backend.model_files import MODEL_DIR_ENV
from python_backend.serving.tokenization import PromptTokenizer
from scripts.clients.llm_client import GenerateClient
from scripts.launcher.triton_server import running_server
from scripts.paths import PROJECT_ROOT
from tests.helpers import NO_EOS, export_tiny, hf_greedy

BOS = "<|endoftext|>"
PROMPTS = ["The quick brown fox", "用一句话介绍一下长城。", "def add(a, b):"]
MAX_TOKENS = 16
# The server stops at end_id and transformers at eos_token_id: NO_EOS is given as both, so that EOS is handled alike
# (the random model's own EOS, <|im_end|>, would otherwise stop one and not the other).


@pytest.fixture(scope="session")
def tiny_model_dir(model_dir, tmp_path_factory) -> Path:
    """A Hugging Face folder: 3-layer random Llama, SmolLM2's vocabulary, a tokenizer with BOS and no template. Three
    layers: its export traces two and copies the second for the third (scripts/prepare/layer_replication.py)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM  # here: every worker collects every file

    folder = tmp_path_factory.mktemp("tiny_llama")
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True, bos_token=BOS, add_bos_token=True)
    tokenizer.chat_template = None
    tokenizer.save_pretrained(folder)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        # Ten times the usual spread: large enough that the next token depends on the whole prompt, BOS included,
        # and not only on the last token (which tied embeddings would otherwise repeat forever).
        initializer_range=0.2,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_export(tiny_model_dir, tmp_path_factory) -> Path:
    output = tmp_path_factory.mktemp("tiny_export")
    export_tiny(tiny_model_dir, output)
    return output


def test_an_export_of_another_model_is_kept_when_no_source_is_named(tiny_model_dir, tmp_path, monkeypatch):
    """`make serve EXPORT_DIR=build/my-model QUANT=fp32` runs the export step without SOURCE: it must keep the user's
    model (the source its mark records, up to date), not export the default model over it."""
    from scripts.prepare import export_onnx
    from scripts.prepare.build_marks import EXPORT_MARK, mark_complete

    output = tmp_path / "my-model"
    output.mkdir()
    (output / "weights.bin").write_bytes(b"the user's export")
    mark_complete(output, EXPORT_MARK, export_onnx.source_fingerprint(tiny_model_dir))
    mark = (output / EXPORT_MARK).read_text()

    def exported_again(source, output):
        raise AssertionError(f"exported {source} again over the user's model")

    monkeypatch.setattr(export_onnx, "load_source", exported_again)
    assert export_onnx.main(["--output", str(output)]) == 0
    assert (output / EXPORT_MARK).read_text() == mark
    assert (output / "weights.bin").read_bytes() == b"the user's export"


def test_an_up_to_date_export_is_told_so_without_importing_torch(model_dir):
    """`make model`, `make serve`, `make batch` and `make test` run the export's step each time: an export that is up
    to date says so before torch and transformers' models are imported (they took 6.6 s of the check's 7.4 s)."""
    import subprocess
    import sys

    from scripts.paths import PROJECT_ROOT

    check = ("import sys; from scripts.prepare import export_onnx; "
             f"code = export_onnx.main(['--output', {str(model_dir)!r}]); "
             "print(code, 'torch' in sys.modules, 'transformers' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", check], cwd=PROJECT_ROOT, capture_output=True, text=True,
                          timeout=300)
    assert "is up to date" in done.stderr and done.stdout.split() == ["0", "False", "False"], done.stdout + done.stderr


def test_an_export_that_fails_stops_its_references_process(tiny_model_dir, tmp_path, monkeypatch):
    """The process computing PyTorch's references beside the tracing (models of REFERENCES_BESIDE_PARAMETERS or more)
    is not left running when the tracing fails."""
    from scripts.prepare import export_onnx, traced_decoder

    started = []
    beside = export_onnx.references_beside

    def recorded(model, output):
        started.append(beside(model, output))
        return started[-1]

    def tracing_fails(model, path, log, every_layer):
        raise RuntimeError("the tracer said no")

    monkeypatch.setattr(export_onnx, "REFERENCES_BESIDE_PARAMETERS", 0)
    monkeypatch.setattr(export_onnx, "references_beside", recorded)
    monkeypatch.setattr(traced_decoder, "export_graph", tracing_fails)
    with pytest.raises(RuntimeError, match="the tracer said no"):
        export_onnx.main(["--source", str(tiny_model_dir), "--output", str(tmp_path / "out")])
    assert started[0] is not None and started[0].wait(timeout=120) == -signal.SIGKILL, "killed, not left computing"


def test_a_model_whose_attention_the_export_lacks_is_refused_before_any_work(tmp_path, capsys):
    """gpt-oss's attention sinks: refused from its config alone, naming why, with nothing written."""
    from transformers import GptOssConfig

    from scripts.prepare import export_onnx

    source = tmp_path / "gpt_oss"
    GptOssConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=16).save_pretrained(source)
    output = tmp_path / "out"
    assert export_onnx.main(["--source", str(source), "--output", str(output)]) == 2
    assert "gpt_oss uses attention sinks" in capsys.readouterr().err
    assert not output.exists(), "nothing half-built is left behind"
    assert export_onnx.refusal(Path(tmp_path / "missing")) is None


@pytest.fixture(scope="session")
def tiny_server(tiny_export, tmp_path_factory):
    log = tmp_path_factory.mktemp("triton_tiny") / "server.log"
    with running_server(log_path=log, env={MODEL_DIR_ENV: str(tiny_export)}) as ports:
        yield ports


@pytest.fixture(scope="session")
def hf_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir, local_files_only=True)


@pytest.fixture(scope="session")
def reference(tiny_model_dir, hf_tokenizer) -> dict[str, list[int]]:
    """transformers' greedy generate() on `tokenizer(text)` ids, BOS included: {prompt: new ids without NO_EOS}."""
    from transformers import LlamaForCausalLM

    from scripts.eval.peft_reference import greedy_ids

    model = LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    return {prompt: greedy_ids(model, hf_tokenizer(prompt).input_ids, MAX_TOKENS, [NO_EOS]) for prompt in PROMPTS}


def test_raw_prompts_start_with_the_bos_the_tokenizer_adds(tiny_model_dir, hf_tokenizer):
    tokenizer = PromptTokenizer(tiny_model_dir)
    assert not tokenizer.has_chat_template
    for prompt in PROMPTS:
        expected = hf_tokenizer(prompt).input_ids
        assert expected[0] == hf_tokenizer.convert_tokens_to_ids(BOS) and expected.count(expected[0]) == 1
        # No template to apply: a chat request is a raw prompt too.
        assert tokenizer.encode(prompt, apply_chat_template=True) == expected
        assert tokenizer.encode(prompt, apply_chat_template=False) == expected


@pytest.mark.server
def test_the_export_records_no_chat_template_passes_parity_and_is_served(tiny_export, tiny_server):
    """The whole export of another model (about 20 s of torch.onnx.export and parity) runs once, for the tests of the
    server that serves it; the served model is the one exported."""
    import json

    settings = json.loads((tiny_export / "llm_settings.json").read_text())
    assert settings["chat_template"] is False and settings["max_position_embeddings"] == 256
    assert json.loads((tiny_export / "parity_report.json").read_text())["passed"]
    with urllib.request.urlopen(f"http://127.0.0.1:{tiny_server.http}/v2/models/llm/ready", timeout=10) as response:
        assert response.status == 200


@pytest.mark.server  # on the export the server tests build (the fast suite leaves both out)
def test_the_copied_layer_computes_what_pytorch_does_on_its_own_weights_and_cache(tiny_export, tiny_model_dir):
    """The export traced two of the three layers and copied the second's graph for the third: on left-padded rows
    with a past, its logits and each layer's present K and V are PyTorch's to float rounding. A copy that read layer
    1's weights or cache instead of its own is off by far more (the weights are random and large)."""
    import numpy as np
    import onnx
    import onnxruntime as ort
    from transformers import LlamaForCausalLM

    from python_backend.model_files import ONNX_FILE
    from scripts.bench.layer_copies import random_feeds
    from scripts.prepare.traced_decoder import DecoderWithCache

    model = LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    layers = model.config.num_hidden_layers
    graph = onnx.load(str(tiny_export / ONNX_FILE), load_external_data=False).graph
    assert any(node.name.endswith("__layer2") for node in graph.node), "the third layer was traced, not copied"
    session = ort.InferenceSession(str(tiny_export / ONNX_FILE))
    feeds = random_feeds(model.config, np.random.default_rng(0))  # a left-padded row, a past
    past = [feeds[f"past_key_values.{i}.{kind}"] for i in range(layers) for kind in ("key", "value")]
    outputs = ["logits"] + [f"present.{i}.{kind}" for i in range(layers) for kind in ("key", "value")]
    assert [i.name for i in session.get_inputs()] == list(feeds) and layers == 3
    assert [o.name for o in session.get_outputs()] == outputs

    ours = session.run(None, feeds)
    with torch.no_grad():
        theirs = DecoderWithCache(model)(*(torch.from_numpy(feeds[k]) for k in list(feeds)[:4]),
                                         *map(torch.from_numpy, past))
    for name, got, expected in zip(outputs, ours, theirs, strict=True):
        assert got.shape == tuple(expected.shape) and np.abs(got - expected.numpy()).max() < 1e-4, name


@pytest.mark.server
@pytest.mark.parametrize("apply_chat_template", [None, True, False], ids=["default", "true", "false"])
def test_served_greedy_output_equals_transformers_generate_on_ids_with_bos(
    tiny_server, reference, hf_tokenizer, apply_chat_template
):
    client = GenerateClient(f"127.0.0.1:{tiny_server.http}")
    for prompt in PROMPTS:
        request = {"text_input": prompt, "max_tokens": MAX_TOKENS, "end_id": NO_EOS}
        if apply_chat_template is not None:
            request["apply_chat_template"] = apply_chat_template
        completion = client.complete(request)
        assert completion.output_tokens == len(reference[prompt]) == MAX_TOKENS, prompt
        assert completion.text == hf_tokenizer.decode(reference[prompt], skip_special_tokens=True), prompt


@pytest.mark.server
def test_int4_of_a_hugging_face_folder_is_refused_before_any_work_and_built_from_it_when_asked(
        tiny_export, tiny_model_dir, tmp_path, capsys):
    """`make model SOURCE=<folder> QUANT=int4`: a random model's weights are on no 4-bit grid, so int4 cannot be exact
    for it: refused at once, naming the matrices, with nothing built. Asked to keep it anyway, the fused graph is built
    from the folder the export's settings name (the export reads a Hugging Face folder where it is, with no hf/ of its
    own; the variant once looked for EXPORT_DIR/hf, which the builder then took for a model hub's name)."""
    import json

    from scripts.prepare import quantize
    from scripts.prepare.build_marks import VARIANT_MARK

    assert not (tiny_export / "hf").exists()
    output = tmp_path / "tiny-int4"
    arguments = ["--quant", "int4", "--source", str(tiny_export), "--output", str(output)]
    refused = quantize.main(arguments)
    stderr = capsys.readouterr().err
    assert refused == 1, stderr[-3000:]
    assert "int4 is exact only for weights already on a 4-bit grid" in stderr
    assert "model.layers.0." in stderr and "Nothing was built" in stderr
    assert not output.exists()
    kept = subprocess.run([sys.executable, "-m", "scripts.prepare.quantize", *arguments, "--keep-inexact"],
                          cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=900)
    assert f"fused graph of {tiny_model_dir.resolve()}" in kept.stderr
    assert kept.returncode == 0 and "WARNING: parity below the thresholds" in kept.stderr, kept.stderr[-3000:]
    assert json.loads((output / "llm_settings.json").read_text())["quantization"] == "int4"
    assert (output / "onnx" / "model.onnx").is_file() and (output / VARIANT_MARK).is_file()


@pytest.mark.server
def test_peft_adapters_of_a_tiny_model_give_peft_s_tokens_on_its_fp32_variant(tiny_export, tiny_model_dir,
                                                                             hf_tokenizer, tmp_path):
    """LoRA on a model other than the default: the tiny Llama's fp32 variant (`make model SOURCE=<folder>
    QUANT=fp32`) holds an adapter graph, and two adapters made with PEFT on the tiny folder (every projection; q and
    v with rsLoRA) give PEFT's own greedy tokens, mixed with the base in one batch."""
    import json

    from python_backend.engine.loop import generate
    from python_backend.engine.sampling import SamplingParams
    from python_backend.engine.sequence import Sequence
    from python_backend.lora import BaseShapes, read_peft
    from python_backend.model_files import ADAPTER_ONNX_FILE
    from python_backend.runtime.onnx_slot_decoder import OnnxSlotDecoder
    from scripts.eval.peft_reference import RUNNERS_UP_FILE
    from tests.helpers import departures

    eval_python = PROJECT_ROOT / ".venv-eval" / "bin" / "python"
    if not eval_python.exists():
        pytest.skip(f"{eval_python} is missing (PEFT lives in the eval venv): make eval-venv")
    variant = tmp_path / "tiny-fp32"
    built = subprocess.run([sys.executable, "-m", "scripts.prepare.quantize", "--quant", "fp32", "--source",
                            str(tiny_export), "--output", str(variant)], cwd=PROJECT_ROOT, capture_output=True,
                           text=True, timeout=900)
    assert built.returncode == 0, built.stderr[-3000:]
    prompts = [hf_tokenizer(prompt).input_ids for prompt in PROMPTS]
    (tmp_path / "prompts.json").write_text(json.dumps(prompts))
    made = subprocess.run([str(eval_python), "-m", "scripts.eval.peft_reference", "--base", str(tiny_model_dir),
                           "--output", str(tmp_path / "lora"), "--prompts", str(tmp_path / "prompts.json"),
                           "--max-tokens", str(MAX_TOKENS), "--eos", str(NO_EOS), "--adapter", "every:4:8:all",
                           "--adapter", "qv:8:16:q_proj,v_proj:rslora"], cwd=PROJECT_ROOT, capture_output=True,
                          text=True, timeout=900)
    assert made.returncode == 0, made.stderr[-3000:]
    reference = json.loads((tmp_path / "lora" / "reference.json").read_text())
    assert all(reference[name] != reference[""] for name in ("every", "qv")), "an adapter that changes nothing"
    base = BaseShapes.from_json(json.loads((variant / "llm_settings.json").read_text())["lora_base"])
    adapters = {name: read_peft(tmp_path / "lora" / name, name, base) for name in ("every", "qv")}
    names = ["", "every", "qv"]
    sequences = [Sequence(prompt_ids=ids, params=SamplingParams(max_tokens=MAX_TOKENS, end_ids=(NO_EOS,)),
                          adapter=adapters.get(name)) for name in names for ids in prompts]
    generate(OnnxSlotDecoder(variant / ADAPTER_ONNX_FILE), sequences, strategy="continuous")
    runners_up = json.loads((tmp_path / "lora" / RUNNERS_UP_FILE).read_text())
    left = departures([s.output_ids for s in sequences], [(name, i) for name in names for i in range(len(prompts))],
                      reference, runners_up, [NO_EOS])
    assert not left, left  # PEFT's tokens, but for a departure at a near tie (tests/helpers.py's NEAR_TIE)


@pytest.fixture(scope="session")
def tiny_gemma2_dir(model_dir, tmp_path_factory) -> Path:
    """A Hugging Face folder: the architectures table's tiny random Gemma 2 (scripts/bench/architectures.py), its
    attention soft cap low enough to change the scores (5; ignored, the export's logits differ by about 3) and a
    sliding window of 32 tokens, shorter than the prompts with their answers, on one of its two layers."""
    from transformers import AutoTokenizer

    from scripts.bench import architectures

    folder = tmp_path_factory.mktemp("tiny_gemma2")
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    config = architectures.configs(tokenizer, layers=2)["gemma2 (soft caps, sliding window)"]  # one of each kind
    assert (config.attn_logit_softcapping, config.sliding_window) == (5.0, 32)
    architectures.make(config, tokenizer, folder)
    return folder


@pytest.mark.server
@pytest.mark.models
def test_gemma2_is_exported_exactly_served_token_exact_and_refused_by_the_fused_graph(tiny_gemma2_dir, tmp_path,
                                                                                       capsys):
    """Gemma 2's soft-capped attention, sliding window and final soft cap: the export's parity against transformers
    holds, the served greedy tokens are transformers' (past the window), and int4/fast, built on a fused graph whose
    sliding-window attention does not run on the slot cache, are refused before any work."""
    import json

    from transformers import AutoTokenizer, Gemma2ForCausalLM

    export = tmp_path / "gemma2"
    export_tiny(tiny_gemma2_dir, export)
    report = json.loads((export / "parity_report.json").read_text())
    assert report["passed"] and report["max_abs_logit_diff"] < 1e-4
    assert report["greedy_agreement"]["identical"] == report["greedy_agreement"]["prompts"]

    tokenizer = AutoTokenizer.from_pretrained(tiny_gemma2_dir, local_files_only=True)
    model = Gemma2ForCausalLM.from_pretrained(tiny_gemma2_dir, dtype=torch.float32, attn_implementation="eager").eval()
    with running_server(log_path=tmp_path / "server.log", env={MODEL_DIR_ENV: str(export)}) as ports:
        client = GenerateClient(f"127.0.0.1:{ports.http}")
        for prompt in PROMPTS:
            ids = tokenizer(prompt).input_ids
            assert len(ids) + 40 > 32, "the answer runs past the sliding window"
            expected = hf_greedy(model, {"eos_token_ids": [NO_EOS]}, ids, 40, eos_token_id=NO_EOS)
            completion = client.complete({"text_input": prompt, "max_tokens": 40, "end_id": NO_EOS,
                                          "apply_chat_template": False})
            assert completion.output_tokens == len(expected) == 40, prompt
            assert completion.text == tokenizer.decode(expected, skip_special_tokens=True), prompt

    from scripts.prepare import fused_graph, quantize

    output = tmp_path / "gemma2-int4"
    assert quantize.main(["--quant", "int4", "--source", str(export), "--output", str(output), "--keep-inexact"]) == 1
    assert "gemma2 has sliding-window layers (sliding_window 32)" in capsys.readouterr().err
    assert not output.exists()
    # fast is refused by the same check of every recipe on the fused graph
    assert "(sliding_window 32)" in fused_graph.refusal(quantize.source_weights(export), "fast")
    # fp32 and fp16 are built on the export's own graph, which serves it token-exactly above
    assert quantize.variant_graph(export, quantize.RECIPES["fp32"])[0] == quantize.EXPORT
