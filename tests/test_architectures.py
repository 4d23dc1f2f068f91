"""The architectures people bring: the architectures table's pieces (scripts/bench/architectures.py) without running a
build (each cell read from the export's and the variant builds' own log lines, a refusal named, a failure shown with
its last line; every architecture's tiny config small and with what sets it apart), and each architecture's tiny
random model exported, built as the default variant and served by a real tritonserver, token-exact against
transformers (Gemma 2 in test_tiny_model.py)."""

import pytest

from scripts.bench.architectures import SERVED_PROMPTS, configs, make, outcome, served
from tests.helpers import export_tinies

# All but Gemma 2 (test_tiny_model.py serves it past its sliding window): each on the fused graph of onnxruntime-genai's
# builder, which reads what sets the architecture apart from its config, but OLMo 2, whose class the builder does not
# take: its fp32 is built on the export's own graph.
SERVED = ("llama3", "mistral", "qwen2", "qwen3", "phi3", "granite", "olmo2")

EXPORT_LINE = ("[export   14.0s] parity: max |Δ logits| = 6.32e-06 (tolerance 0.001), greedy identical 4/4; on the "
               "load-test prompts 42/42 over 64 tokens\n[export   14.0s] done: build/x")
VARIANT_LINE = ("[parity] fp16: max |Δ logits| 0.0335; greedy identical 40/42 over 64 tokens, mean 61.5 tokens to the "
                "first difference; passed\n[quantize] done: build/x-fp16")


def test_each_cell_is_read_from_the_builds_own_lines():
    assert outcome(0, EXPORT_LINE) == "built: 6.3e-06, 42/42"
    assert outcome(0, VARIANT_LINE) == "built: 0.034, 40/42"
    assert outcome(1, VARIANT_LINE) == "FAILED: 0.034, 40/42"
    assert outcome(0, "[quantize] fp32: built on the export's own graph (its padded cache: no prefix caching), as ...\n"
                      + VARIANT_LINE) == "built: 0.034, 40/42 (on the export's graph)"
    assert outcome(1, "[quantize] int4 is exact only for weights already on a 4-bit grid in blocks of 32 (GGUF "
                      "...)") == "refused: off its grid"
    assert outcome(1, "[quantize] fast is built on ...: gemma2 has sliding-window layers (sliding_window 32).") == (
        "refused: sliding window")
    assert outcome(1, "Traceback ...\nRuntimeError: the kernel said no\n") == (
        "failed (exit 1): RuntimeError: the kernel said no")


@pytest.fixture(scope="module")
def auto_tokenizer(model_dir):
    """The served model's tokenizer, which every tiny model takes."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)


def test_every_architectures_config_is_tiny_and_keeps_its_own_features(auto_tokenizer):
    tiny = configs(auto_tokenizer)
    assert len(tiny) == 8
    assert {name.split()[0] for name in tiny} == {*SERVED, "gemma2"}, "every architecture of the table is served here"
    for name, config in tiny.items():
        assert config.num_hidden_layers == 4 and config.hidden_size == 64, name
        assert config.vocab_size == len(auto_tokenizer), name
    assert tiny["gemma2 (soft caps, sliding window)"].attn_logit_softcapping == 5.0
    assert tiny["granite (multipliers)"].logits_scaling == 8.0
    assert tiny["qwen2 (biases)"].model_type == "qwen2" and tiny["olmo2 (post-norms, q/k norms)"].model_type == "olmo2"


def test_a_sliding_window_the_fused_graph_leaves_out_caps_the_fused_variants_context(tmp_path):
    """Mistral v0.1 and Phi-3-mini-4k window every layer without naming them in `layer_types`; the builder then
    gives every layer full attention, the same answers while a sequence fits in the window: the fused variants' served
    context is capped there. fp32 and fp16 are built on the export's own graph instead, which applies the window, and
    keep the model's context; a window as long as the context needs neither."""
    import json

    import transformers as tf

    from python_backend.model_files import SETTINGS_FILE
    from scripts.prepare import quantize

    def context_of(name: str, config: dict, recipe: str) -> int:
        export = tmp_path / name
        (export / "hf").mkdir(parents=True, exist_ok=True)
        (export / "hf" / "config.json").write_text(json.dumps(config))
        (export / SETTINGS_FILE).write_text(json.dumps({"max_position_embeddings": 4096, "eos_token_ids": [2]}))
        output = tmp_path / f"{name}-{recipe}"
        output.mkdir(exist_ok=True)
        graph, _ = quantize.variant_graph(export, quantize.RECIPES[recipe])
        quantize.copy_model_files(export, output, quantize.RECIPES[recipe], graph)
        return json.loads((output / SETTINGS_FILE).read_text())["max_position_embeddings"]

    phi3 = tf.Phi3Config(sliding_window=2047).to_dict()
    assert context_of("phi3", phi3, "fast") == context_of("phi3", phi3, "int4") == 2047
    assert context_of("phi3", phi3, "fp16") == context_of("phi3", phi3, "fp32") == 4096
    assert quantize.variant_graph(tmp_path / "phi3", quantize.RECIPES["fp32"])[0] == quantize.EXPORT
    assert context_of("mistral", tf.MistralConfig(sliding_window=1024).to_dict(), "fast") == 1024
    assert context_of("mistral-wide", tf.MistralConfig(sliding_window=8192).to_dict(), "fast") == 4096
    assert context_of("mistral-none", tf.MistralConfig(sliding_window=None).to_dict(), "fast") == 4096
    # Qwen2's saved configs keep a window they do not use
    unused = {"model_type": "qwen2", "sliding_window": 1024, "use_sliding_window": False}
    assert context_of("qwen2", unused, "fast") == 4096
    assert context_of("llama", tf.LlamaConfig().to_dict(), "fast") == 4096
    assert context_of("mistral-wide", tf.MistralConfig(sliding_window=8192).to_dict(), "fp32") == 4096
    for fused in ("llama", "mistral-wide", "qwen2"):
        assert quantize.variant_graph(tmp_path / fused, quantize.RECIPES["fp32"])[0] == quantize.FUSED


def test_a_model_class_the_builder_does_not_take_is_refused_before_any_work(tmp_path, capsys):
    """OLMo 2: onnxruntime-genai's builder has no Olmo2ForCausalLM, so `fast` and `int4` are refused from the config
    in a moment, naming it and what the builder takes, with nothing written; fp32 and fp16 go to the export's graph."""
    import json

    import transformers as tf

    from python_backend.model_files import SETTINGS_FILE
    from scripts.prepare import fused_graph, quantize
    from scripts.prepare.build_marks import EXPORT_MARK

    assert {"LlamaForCausalLM", "Qwen3ForCausalLM", "Gemma2ForCausalLM"} <= fused_graph.builder_architectures()
    export = tmp_path / "olmo2"
    (export / "hf").mkdir(parents=True)
    (export / "hf" / "config.json").write_text(tf.Olmo2Config(architectures=["Olmo2ForCausalLM"]).to_json_string())
    (export / SETTINGS_FILE).write_text(json.dumps({"max_position_embeddings": 4096, "eos_token_ids": [2]}))
    (export / EXPORT_MARK).write_text("{}")
    why = fused_graph.refusal(export / "hf", "fast")
    assert "Olmo2ForCausalLM" in why and "LlamaForCausalLM" in why and "QUANT=fp32" in why
    assert quantize.main(["--quant", "fast", "--source", str(export)]) == 1
    assert "Olmo2ForCausalLM" in capsys.readouterr().err and not (tmp_path / "olmo2-fast").exists()
    assert quantize.variant_graph(export, quantize.RECIPES["fp32"])[0] == quantize.EXPORT
    assert outcome(1, why) == "refused: not in onnxruntime-genai's builder"
    llama = tmp_path / "llama"
    llama.mkdir()
    (llama / "config.json").write_text(tf.LlamaConfig(architectures=["LlamaForCausalLM"]).to_json_string())
    assert fused_graph.refusal(llama, "fast") is None


@pytest.fixture(scope="module")
def built(request, auto_tokenizer, tmp_path_factory) -> dict[str, tuple]:
    """Each architecture of SERVED this session runs, its tiny model made, exported and built as the default variant
    in one process (export_tinies): architecture -> (its folder, its export, its build's failure or None)."""
    running = {item.callspec.params["architecture"] for item in request.session.items
               if item.originalname == test_each_architectures_default_variant_is_built_and_served_token_exact.__name__}
    # One layer: what sets each apart is in every layer, and the cache's wiring across layers is the same code for
    # all (checked on SmolLM2's 30 and the tiny engine model's 2). The seven builds took 78 CPU-s against 102 with 2
    # layers (2026-12-07, 2-core machine).
    tiny = {name.split()[0]: config for name, config in configs(auto_tokenizer, layers=1).items()}
    work = tmp_path_factory.mktemp("architectures")
    folders = {name: (work / name, work / f"{name}-export") for name in SERVED if name in running}
    for name, (source, _) in folders.items():
        make(tiny[name], auto_tokenizer, source)
    failures = export_tinies(list(folders.values()), variants=("fp32",))
    return {name: (source, export, failures[export]) for name, (source, export) in folders.items()}


@pytest.mark.server
@pytest.mark.models
@pytest.mark.parametrize("architecture", SERVED)
def test_each_architectures_default_variant_is_built_and_served_token_exact(architecture, built, auto_tokenizer,
                                                                            tmp_path):
    """`make model SOURCE=<folder>` then `make serve`: the export and its fp32 variant (the fused graph, with the
    architecture's rope scaling, biases, q/k norms, fused projections or multipliers taken from its config; OLMo 2's
    on the export's graph) pass their parity checks, and a real tritonserver's greedy text is transformers' own on
    every prompt."""
    from scripts.prepare import quantize

    source, export, failure = built[architecture]
    assert failure is None, failure
    graph = quantize.variant_graph(export, quantize.RECIPES["fp32"])[0]
    assert graph == (quantize.EXPORT if architecture == "olmo2" else quantize.FUSED)
    result = served(source, quantize.variant_dir(export, "fp32"), auto_tokenizer, tmp_path / "server.log")
    assert result == f"{len(SERVED_PROMPTS)}/{len(SERVED_PROMPTS)} token-exact"
