"""LoRA adapters (issue 35): PEFT folders read and checked against the base model; the fused graph's per-row adapter
inputs (scripts/prepare/lora_graph.py, python_backend/lora.py) on a small graph named as onnxruntime-genai's builder
names its projections, rows with different adapters and rows without one in the same call, each equal to PEFT's
arithmetic on its own adapter; the served model's variants with PEFT's own adapters in the engine, token-exact against
PEFT; and served: the ensemble, the OpenAI API, loads and unloads while serving, batch files, metrics, the KV budget."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from python_backend.lora import AdapterError, AdapterInputs, BaseShapes, read_peft
from scripts.prepare.lora_graph import add_adapter_inputs
from tests.helpers import metric_samples, metrics, wait_for, wait_idle

CONFIG = {"hidden_size": 8, "num_attention_heads": 2, "head_dim": 4, "num_key_value_heads": 1,
          "intermediate_size": 12, "num_hidden_layers": 2}
BASE = BaseShapes.from_config(CONFIG)
ATTN, MLP = ("q_proj", "k_proj", "v_proj", "o_proj"), ("gate_proj", "up_proj", "down_proj")
MIX = (np.arange(1, 17, dtype=np.float32) / 16)[:, None] * np.ones((1, 8), np.float32)  # packed QKV -> hidden


def base_weights(rng) -> dict[tuple[int, str], np.ndarray]:
    """Scaled so that values stay near 1 through both layers (a delta misplaced must not drown in their size)."""
    return {(layer, module): (rng.standard_normal(BASE.modules[module]) / np.sqrt(BASE.modules[module][0]))
            .astype(np.float32) for layer in range(2) for module in (*ATTN, *MLP)}


def graph(weights) -> onnx.ModelProto:
    """Two layers of the fused graph's projections (packed QKV), chained as x -> q -> o -> gate * up -> down."""
    nodes, initializers, x = [], [], "x"
    for layer in range(2):
        def product(kind, inputs, weight, part):
            name = f"/model/layers.{layer}/{part}/{kind}/MatMul"
            initializers.append(numpy_helper.from_array(weight, f"w.{layer}.{kind}"))
            nodes.append(helper.make_node("MatMul", [inputs, f"w.{layer}.{kind}"], [f"{name}/output_0"], name=name))
            return f"{name}/output_0"

        qkv = product("qkv_proj", x, np.concatenate([weights[(layer, m)] for m in ATTN[:3]], axis=1), "attn")
        initializers += [numpy_helper.from_array(np.array(v, np.int64), f"s.{layer}.{i}")
                         for i, v in enumerate(([0], [8], [2]))]
        nodes.append(helper.make_node("Slice", [qkv, f"s.{layer}.0", f"s.{layer}.1", f"s.{layer}.2"], [f"q.{layer}"]))
        o = product("o_proj", f"q.{layer}", weights[(layer, "o_proj")], "attn")
        gate = product("gate_proj", o, weights[(layer, "gate_proj")], "mlp")
        up = product("up_proj", o, weights[(layer, "up_proj")], "mlp")
        nodes.append(helper.make_node("Mul", [gate, up], [f"m.{layer}"]))
        down = product("down_proj", f"m.{layer}", weights[(layer, "down_proj")], "mlp")
        # every column of the packed QKV feeds the next layer, each with its own weight: k's and v's deltas are seen
        # in their own places
        nodes.append(helper.make_node("MatMul", [qkv, f"mix.{layer}"], [f"kv.{layer}"], name=f"mix.{layer}"))
        initializers.append(numpy_helper.from_array(MIX, f"mix.{layer}"))
        nodes.append(helper.make_node("Add", [down, f"kv.{layer}"], [f"h.{layer}"]))
        x = f"h.{layer}"
    nodes.append(helper.make_node("Identity", [x], ["y"]))
    made = helper.make_graph(nodes, "projections", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                                  ["batch_size", "new", 8])],
                             [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch_size", "new", 8])],
                             initializers)
    return helper.make_model(made, opset_imports=[helper.make_opsetid("", 17)])


def reference(weights, x, adapter: dict | None) -> np.ndarray:
    """The same chain in numpy, each targeted module's delta as PEFT computes it: (x A^T) B^T * scaling."""
    def project(layer, module, inputs):
        y = inputs @ weights[(layer, module)]
        if adapter and (layer, module) in adapter["pairs"]:
            a, b = adapter["pairs"][(layer, module)]
            y = y + (inputs @ a.T) @ b.T * adapter["scaling"]
        return y

    for layer in range(2):
        q, k, v = (project(layer, m, x) for m in ATTN[:3])
        o = project(layer, "o_proj", q)
        down = project(layer, "down_proj", project(layer, "gate_proj", o) * project(layer, "up_proj", o))
        x = down + np.concatenate([q, k, v], axis=-1) @ MIX
    return x


def write_peft(folder, rng, rank, modules, layers=(0, 1), alpha=16, **config) -> dict:
    from safetensors.numpy import save_file

    folder.mkdir(parents=True)
    pairs, tensors = {}, {}
    for layer in layers:
        for module in modules:
            features_in, features_out = BASE.modules[module]
            a = rng.standard_normal((rank, features_in)).astype(np.float32)
            b = rng.standard_normal((features_out, rank)).astype(np.float32)
            prefix = f"base_model.model.model.layers.{layer}.{'self_attn' if module in ATTN else 'mlp'}.{module}"
            tensors[f"{prefix}.lora_A.weight"], tensors[f"{prefix}.lora_B.weight"] = a, b
            pairs[(layer, module)] = (a, b)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": alpha,
                                                            "target_modules": list(modules), **config}))
    scaling = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
    return {"pairs": pairs, "scaling": scaling}


@pytest.fixture()
def rng():
    return np.random.default_rng(7)


def test_rows_with_different_adapters_and_none_get_each_their_own_adapters_output(tmp_path, rng):
    weights = base_weights(rng)
    model = graph(weights)
    targets = {(t.layer, t.kind): (t.in_features, t.out_features) for t in add_adapter_inputs(model, BASE)}
    assert len(targets) == 10
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    plain = ort.InferenceSession(graph(weights).SerializeToString(), providers=["CPUExecutionProvider"])
    # q and v (PEFT's default for Llama) plus o and down; and every projection, rsLoRA, on layer 1 only
    x_spec = write_peft(tmp_path / "x", rng, 2, ("q_proj", "v_proj", "o_proj", "down_proj"))
    y_spec = write_peft(tmp_path / "y", rng, 3, (*ATTN, *MLP), layers=(1,), use_rslora=True)
    adapters = {"x": read_peft(tmp_path / "x", "x", BASE), "y": read_peft(tmp_path / "y", "y", BASE)}
    assert adapters["x"].widths == {"qkv_proj": 4, "o_proj": 2, "down_proj": 2}
    inputs = AdapterInputs(targets)
    x = rng.standard_normal((4, 3, 8)).astype(np.float32)
    rows = [adapters["x"], None, adapters["y"], adapters["x"]]
    out = session.run(["y"], {"x": x, **inputs.for_rows(rows)})[0]
    specs = [x_spec, None, y_spec, x_spec]
    for row, spec in enumerate(specs):
        np.testing.assert_allclose(out[row], reference(weights, x[row], spec), rtol=1e-4, atol=1e-4)
    expected_base = plain.run(["y"], {"x": x})[0]
    assert np.array_equal(out[1], expected_base[1]), "a row without an adapter gets the base model's bits"
    assert not np.allclose(out[0], expected_base[0]) and not np.allclose(out[2], expected_base[2])
    # no adapter in the step: every width 0, the base model's output bit for bit
    none = session.run(["y"], {"x": x, **inputs.for_rows([None] * 4)})[0]
    assert np.array_equal(none, expected_base)


def test_a_folder_that_does_not_fit_the_base_is_refused_naming_what(tmp_path, rng):
    write_peft(tmp_path / "ok", rng, 2, ("q_proj",))
    read_peft(tmp_path / "ok", "ok", BASE)
    cases = {
        "wide": (dict(rank=2, modules=("q_proj",)), {"hidden_size": 16}, r"layer 0 q_proj.lora_A is \[2, 8\]; this "
                                                                         r"base model needs \[2, 16\]"),
        "deep": (dict(rank=2, modules=("o_proj",), layers=(5,)), {}, "names layer 5; the base model has 2"),
        "dora": (dict(rank=2, modules=("q_proj",), use_dora=True), {}, "DoRA is not supported"),
        "big": (dict(rank=80, modules=("q_proj",)), {}, "rank 80 is beyond max_lora_rank 64"),
    }
    for name, (peft, config, message) in cases.items():
        write_peft(tmp_path / name, rng, **peft)
        with pytest.raises(AdapterError, match=message):
            read_peft(tmp_path / name, name, BaseShapes.from_config({**CONFIG, **config}))
    from safetensors.numpy import save_file

    (tmp_path / "head").mkdir()
    save_file({"base_model.model.lm_head.lora_A.weight": np.zeros((2, 8), np.float32)},
              str(tmp_path / "head" / "adapter_model.safetensors"))
    (tmp_path / "head" / "adapter_config.json").write_text(json.dumps({"r": 2, "lora_alpha": 4}))
    with pytest.raises(AdapterError, match="lm_head.lora_A.weight is not a LoRA matrix of a projection"):
        read_peft(tmp_path / "head", "head", BASE)
    with pytest.raises(AdapterError, match="has no adapter_config.json"):
        read_peft(tmp_path / "nowhere", "nowhere", BASE)


def test_the_store_keeps_max_loras_resident_reads_dropped_ones_again_and_refuses_what_it_cannot_keep(tmp_path, rng):
    from python_backend.lora import AdapterStore, UnknownAdapterError

    for name in "abc":
        write_peft(tmp_path / name, rng, 2, ("q_proj",))
    store = AdapterStore(BASE, max_loras=2)
    a = store.load("a", tmp_path / "a")
    assert store.load("a", tmp_path / "a") is a  # the same folder again: nothing new
    with pytest.raises(AdapterError, match="already loaded from"):
        store.load("a", tmp_path / "b")
    b = store.load("b", tmp_path / "b")
    store.get("a")  # a used last: b is the least recently used
    c = store.load("c", tmp_path / "c")
    assert store.names() == ["a", "b", "c"] and store.resident_bytes() == 2 * a.nbytes()
    assert store.get("c") is c and store.get("a") is a  # both still resident
    again = store.get("b")  # dropped, read again: the same registration, the same prefix-cache key
    assert again is not b and again.key == b.key
    store.unload("b")
    with pytest.raises(UnknownAdapterError, match=r"'b' is not loaded \(loaded: a, c\)"):
        store.get("b")
    with pytest.raises(UnknownAdapterError):
        store.unload("b")
    with pytest.raises(AdapterError, match="none of , = or newline"):
        store.load("x,y", tmp_path / "a")


def test_lora_settings_come_from_the_config_and_the_environment():
    from python_backend.lora import parse_modules
    from python_backend.serving.llm_adapters import DEFAULT_MAX_LORAS, LORA_MODULES_ENV, LoraSettings

    assert not LoraSettings.from_parameters({}, environ={}).enabled
    assert LoraSettings.from_parameters({"max_loras": "2"}, environ={}).enabled
    named = LoraSettings.from_parameters({"lora_modules": "a=/x"}, environ={LORA_MODULES_ENV: "b=rel/y, c=/z"})
    assert named.modules == {"a": "/x", "b": "rel/y", "c": "/z"} and named.max_loras == DEFAULT_MAX_LORAS
    assert parse_modules("") == {}
    with pytest.raises(ValueError, match="expected name=path"):
        LoraSettings.from_parameters({"lora_modules": "a"}, environ={})


def test_adapters_memory_is_kept_from_the_kv_budget(tmp_path, rng):
    from python_backend.engine.scheduler import SchedulerConfig
    from python_backend.lora import adapter_bytes
    from python_backend.serving.llm_adapters import LoraSettings

    write_peft(tmp_path / "all", rng, 4, ATTN + MLP)  # every projection of both layers: the most rank 4 holds
    assert adapter_bytes(BASE, 4) == read_peft(tmp_path / "all", "all", BASE).nbytes()
    settings = LoraSettings(max_loras=3, max_rank=4)
    assert settings.reserved_bytes(BASE) == 2 * 3 * adapter_bytes(BASE, 4)  # resident, and a step's joined copy
    assert LoraSettings(max_loras=0).reserved_bytes(BASE) == 0
    params = {"kv_cache_budget_mb": "1", "batching_strategy": "continuous", "max_queue_size": "8",
              "max_prefill_tokens": "64", "static_timeout_ms": "10"}
    whole = SchedulerConfig.from_parameters(params, 4, 64, "slots", max_context_length=128)
    less = SchedulerConfig.from_parameters(params, 4, 64, "slots", max_context_length=128,
                                           reserved_bytes=settings.reserved_bytes(BASE), max_adapters_per_step=3)
    assert whole.kv_budget_tokens == 2**20 // 64
    assert less.kv_budget_tokens == (2**20 - settings.reserved_bytes(BASE)) // 64 and less.max_adapters_per_step == 3
    with pytest.raises(ValueError, match="leave less than one sequence's KV cache"):
        SchedulerConfig.from_parameters(params, 4, 64, "slots", max_context_length=128,
                                        reserved_bytes=2**20 - 64 * 127)


# --- the served model with PEFT's own adapters, in the engine ---

ADAPTER_SPECS = {"sql": "8:16:q_proj,v_proj", "chat": "16:16:all:rslora"}  # PEFT's Llama default, and every projection
MAX_TOKENS = 16


def peft_reference(settings: dict, prompts: list[list[int]]) -> tuple[Path, list[list[int]], dict]:
    """Adapters made with PEFT on an export's base weights (random B: the answers change) and PEFT's greedy tokens
    for these prompts with each and with none (scripts/eval/peft_reference.py, in the eval venv): (its folder, the
    prompts, name -> answers). Kept under build/ by a digest of what makes them (the script, the base's config and
    the tiny model's weights, the prompts, the specs): made once."""
    import hashlib

    from scripts.eval.peft_reference import EVAL_PYTHON, cached_run
    from tests.tiny_engine_model import RECIPE_FILE

    if not EVAL_PYTHON.exists():
        pytest.skip(f"{EVAL_PYTHON} is missing (PEFT lives in the eval venv): make eval-venv")
    hf_dir = Path(settings["hf_dir"])
    arguments = ["--base", str(hf_dir), "--max-tokens", str(MAX_TOKENS),
                 "--eos", ",".join(map(str, settings["eos_token_ids"])),
                 *(f"--adapter={name}:{spec}" for name, spec in ADAPTER_SPECS.items())]
    made_of = [(hf_dir / "config.json").read_text()]
    if (hf_dir / RECIPE_FILE).is_file():  # the tiny model's weights are drawn here: they key its answers too
        made_of.append(hashlib.sha256((hf_dir / "model.safetensors").read_bytes()).hexdigest())
    folder = cached_run(arguments, {"prompts": prompts}, made_of)
    return folder, prompts, json.loads((folder / "reference.json").read_text())


def test_an_answer_may_leave_the_reference_only_at_a_near_tie_and_only_for_its_runner_up():
    from scripts.eval.peft_reference import departure
    from tests.helpers import NEAR_TIE

    runners_up = [(5, 0.5), (7, 0.001), (2, 0.005)]  # each step's runner-up and its distance below the chosen token
    assert departure([1, 2, 3], [1, 2, 3], runners_up, [0], NEAR_TIE) is None
    assert departure([1, 7, 9], [1, 2, 3], runners_up, [0], NEAR_TIE) is None  # step 1: a near tie, 7 its runner-up
    assert departure([1, 8, 3], [1, 2, 3], runners_up, [0], NEAR_TIE) == "token 1: 8 against 2 (runner-up 7, " \
                                                                         "0.001 below)"
    assert departure([1, 7, 9], [1, 2, 3], runners_up, [0], 0.0005) is not None  # not near enough
    assert departure([5, 2, 3], [1, 2, 3], runners_up, [0], NEAR_TIE) is not None  # the runner-up, but 0.5 below
    assert departure([1, 2], [1, 2, 3], runners_up, [2], NEAR_TIE) is None  # ended where an end token is runner-up
    assert departure([1, 2], [1, 2, 3], runners_up, [0], NEAR_TIE) is not None
    assert departure([1, 2, 3, 4], [1, 2, 3], [*runners_up, (4, 0.3)], [0], NEAR_TIE) is not None  # it ended, clearly
    assert departure([1, 2, 3, 4], [1, 2, 3], [*runners_up, (4, 0.001)], [0], NEAR_TIE) is None  # it ended, nearly
    assert departure([1, 2, 3, 4], [1, 2, 3], runners_up, [0], NEAR_TIE) == "token 3: past the reference's last step"


@pytest.fixture(scope="module")
def peft_run(settings, kv_prompts):
    """PEFT's adapters and answers on the served model (four chat prompts)."""
    return peft_reference(settings, kv_prompts[:4])


class LoraCase:
    """A variant's adapter graph on the CPU, beside PEFT's adapters and answers on its base."""

    def __init__(self, export: Path, variant: str, prompts: list[list[int]]):
        from python_backend.model_files import ADAPTER_ONNX_FILE, SETTINGS_FILE
        from python_backend.runtime.onnx_slot_decoder import OnnxSlotDecoder
        from scripts.eval.peft_reference import RUNNERS_UP_FILE
        from tests.helpers import NEAR_TIE, variant_folder

        self.settings = json.loads((export / SETTINGS_FILE).read_text())
        self.decoder = OnnxSlotDecoder(variant_folder(export, variant) / ADAPTER_ONNX_FILE)
        config = json.loads((Path(self.settings["hf_dir"]) / "config.json").read_text())
        assert len(self.decoder.lora_targets) == 5 * config["num_hidden_layers"]
        self.base = BaseShapes.from_config(config)
        self.folder, self.prompts, self.reference = peft_reference(self.settings, prompts)
        self.runners_up = json.loads((self.folder / RUNNERS_UP_FILE).read_text())
        self.near_tie = 0.0 if variant == "int4" else NEAR_TIE  # int4's products give back the GGUF's weights: exact

    def check(self, answers: list[list[int]], keys: list[tuple[str, int]]) -> None:
        """Each answer is PEFT's for its (adapter name, prompt index), but for a departure at a near tie."""
        from tests.helpers import departures

        left = departures(answers, keys, self.reference, self.runners_up, self.settings["eos_token_ids"],
                          self.near_tie)
        assert not left, left

    def adapters(self) -> dict:
        """Each adapter read from its folder (a fresh load: another adapter for the prefix cache)."""
        return {name: read_peft(self.folder / name, name, self.base) for name in ADAPTER_SPECS}


@pytest.fixture(scope="module", params=["fp32", "int4"])
def lora_case(request, model_dir, tiny_dir, kv_prompts):
    """fp32: the engine tests' tiny model's (tests/tiny_engine_model.py: the engine's logic, whatever the weights);
    int4: the default model's (exact: its 4-bit base products give back the GGUF's weights, and the adapters' deltas
    are fp32)."""
    return LoraCase(tiny_dir if request.param == "fp32" else model_dir, request.param, kv_prompts[:4])


@pytest.fixture
def lora_core(lora_case):
    """An engine core on it (its prefix cache empty): continuous batching with prefix caching."""
    from python_backend.engine.core import EngineCore
    from python_backend.engine.scheduler import SchedulerConfig

    return EngineCore(lora_case.decoder, SchedulerConfig(max_batch_size=16, kv_layout="slots",
                                                         max_context_length=512, kv_budget_tokens=16384,
                                                         enable_kv_cache_reuse=True))


def run(core, sequences) -> list[list[int]]:
    for seq in sequences:
        core.add(seq)
    while core.step().progressed:
        pass
    return [seq.output_ids for seq in sequences]


def sequences(prompts, adapters, settings, names):
    from python_backend.engine.sampling import SamplingParams
    from python_backend.engine.sequence import Sequence

    return [Sequence(prompt_ids=list(prompt), params=SamplingParams(max_tokens=MAX_TOKENS,
                                                                     end_ids=tuple(settings["eos_token_ids"])),
                     adapter=adapters.get(name)) for name in names for prompt in prompts]


def test_rows_with_peft_adapters_and_the_base_mixed_in_one_batch_give_peft_s_greedy_tokens(lora_case, lora_core):
    prompts, reference, settings, adapters = lora_case.prompts, lora_case.reference, lora_case.settings, \
        lora_case.adapters()
    assert all(reference[name] != reference[""] for name in ADAPTER_SPECS), "an adapter that changes nothing"
    names = ["", "sql", "chat"]
    keys = [(name, i) for name in names for i in range(len(prompts))]
    answers = run(lora_core, sequences(prompts, adapters, settings, names))  # 12 rows in one batch
    lora_case.check(answers, keys)
    hits = lora_core.prefix.hit_tokens
    again = sequences(prompts, adapters, settings, list(reversed(names)))  # from the prefix cache, other rows
    assert run(lora_core, again) == [answers[keys.index((name, i))] for name in reversed(names)
                                     for i in range(len(prompts))]
    assert lora_core.prefix.hit_tokens > hits


@pytest.mark.parametrize("lora_case", ["fp32"], indirect=True)  # the prefix cache's keys: one variant is enough
def test_a_prefix_cached_under_one_adapter_is_never_used_under_another(lora_case, lora_core):
    settings, adapters = lora_case.settings, lora_case.adapters()
    prompt = [lora_case.prompts[1]]
    first = run(lora_core, sequences(prompt, adapters, settings, ["sql"]))
    lora_case.check(first, [("sql", 1)])
    for name in ("chat", ""):  # the same tokens under another adapter, and the base: nothing found
        hits = lora_core.prefix.hit_tokens
        lora_case.check(run(lora_core, sequences(prompt, adapters, settings, [name])), [(name, 1)])
        assert lora_core.prefix.hit_tokens == hits, name
    hits = lora_core.prefix.hit_tokens
    assert run(lora_core, sequences(prompt, adapters, settings, ["sql"])) == first  # from the cache: the same tokens
    assert lora_core.prefix.hit_tokens > hits
    # the same name loaded again is another adapter: its prefixes are its own
    again = {"sql": read_peft(lora_case.folder / "sql", "sql", lora_case.base)}
    hits = lora_core.prefix.hit_tokens
    assert run(lora_core, sequences(prompt, again, settings, ["sql"])) == first
    assert lora_core.prefix.hit_tokens == hits


@pytest.mark.parametrize("lora_case", ["fp32"], indirect=True)  # scheduling: one variant is enough
def test_a_step_runs_at_most_max_adapters_per_step_and_requests_for_another_wait_their_turn(lora_case):
    from python_backend.engine.core import EngineCore
    from python_backend.engine.sampling import SamplingParams
    from python_backend.engine.scheduler import SchedulerConfig
    from python_backend.engine.sequence import Sequence

    prompts, settings, adapters = lora_case.prompts, lora_case.settings, lora_case.adapters()
    core = EngineCore(lora_case.decoder, SchedulerConfig(max_batch_size=16, kv_layout="slots",
                                                         max_context_length=512, kv_budget_tokens=16384,
                                                         max_adapters_per_step=1))
    order = [("sql", 0), ("chat", 1), ("", 2), ("sql", 3)]
    seqs = [Sequence(prompt_ids=list(prompts[i]), params=SamplingParams(
        max_tokens=MAX_TOKENS, end_ids=tuple(settings["eos_token_ids"])), adapter=adapters.get(name))
        for name, i in order]
    for seq in seqs:
        core.add(seq)
    in_step = []
    while core.step().progressed:
        in_step.append({s.adapter.name for s in core.running + core.prefilling if s.adapter is not None})
        if len(in_step) == 1:  # the base's request went ahead; the sql one behind chat's waits (no starving)
            assert seqs[2] in core.running + core.prefilling and list(core.waiting) == [seqs[1], seqs[3]]
    assert max(len(names) for names in in_step) == 1 and {"sql"} in in_step and {"chat"} in in_step
    lora_case.check([seq.output_ids for seq in seqs], order)


@pytest.mark.server  # slow in a clean clone (15-35 s: PEFT's own answers, in the eval venv): out of the fast suite
def test_the_int4_variant_s_lora_parity_report_holds_each_adapter_to_the_variant_s_thresholds(peft_run, model_dir,
                                                                                             tmp_path):
    from scripts.eval.lora_parity import main
    from tests.helpers import variant_folder

    folder, _, _ = peft_run
    output = tmp_path / "lora_parity.json"
    code = main(["--model-dir", str(variant_folder(model_dir, "int4")), "--prompts", "4", "--tokens", "16",
                 "--output", str(output), *(f"--adapter={name}={folder / name}" for name in ADAPTER_SPECS)])
    report = json.loads(output.read_text())
    assert report["variant"] == "int4" and set(report["results"]) == {"base", *ADAPTER_SPECS}
    for name, result in report["results"].items():  # PEFT's own model loaded from the folder, in fp32
        assert result["greedy_agreement"]["identical"] == 4 and result["max_abs_logit_diff"] < 1e-3, name
    assert code == 0 and report["passed"]


# --- served: the llm model with adapters named at start, the ensemble and the OpenAI API ---

@pytest.fixture(scope="module")
def lora_modules(peft_run) -> str:
    folder, _, _ = peft_run
    return ",".join(f"{name}={folder / name}" for name in ADAPTER_SPECS)


@pytest.fixture(scope="module")
def lora_server(servers, model_dir, lora_modules):
    """The fp32 variant served with the two PEFT adapters named at start (as `make serve LORA_MODULES=...`)."""
    from python_backend.serving.llm_adapters import LORA_MODULES_ENV
    from tests.helpers import variant_folder

    return servers.get(variant_folder(model_dir, "fp32"), env={LORA_MODULES_ENV: lora_modules})


@pytest.fixture(scope="module")
def lora_api(lora_server, model_dir, lora_modules, tmp_path_factory):
    """The OpenAI API in front of it, told the same adapters; yields its official client."""
    import openai

    from scripts.launcher.openai_server import running_openai_api

    log = tmp_path_factory.mktemp("lora-openai") / "service.log"
    with running_openai_api(f"127.0.0.1:{lora_server.grpc}", model_dir, log,
                            extra_args=("--lora-modules", lora_modules)) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)


def adapter_counts(server) -> dict[tuple[str, str], float]:
    """(metric, adapter) -> value of the llm model's per-adapter counters."""
    return {(sample.name, sample.labels["adapter"]): sample.value for sample in metric_samples(server)
            if sample.name in ("llm_lora_output_tokens_total", "llm_lora_requests_total")}


@pytest.mark.server
def test_the_openai_api_serves_each_adapter_as_a_model_mixed_with_the_base_as_peft_answers(peft_run, lora_server,
                                                                                          lora_api, model, tokenizer):
    from concurrent.futures import ThreadPoolExecutor

    _, prompts, reference = peft_run
    cards = {card.id: card for card in lora_api.models.list().data}
    assert set(cards) == {model, *ADAPTER_SPECS}
    assert all(cards[name].model_extra["parent"] == model for name in ADAPTER_SPECS)
    jobs = [(name or model, i) for name in ("", *ADAPTER_SPECS) for i in range(len(prompts))] * 3  # 36 at once

    def complete(job):
        served, i = job
        answer = lora_api.completions.create(model=served, prompt=prompts[i], max_tokens=MAX_TOKENS, temperature=0)
        return answer.model, answer.choices[0].text, answer.usage.completion_tokens

    wait_idle(lora_server)
    before = adapter_counts(lora_server)
    with ThreadPoolExecutor(len(jobs)) as pool:
        answers = list(pool.map(complete, jobs))
    for (served, i), (named, text, _) in zip(jobs, answers):
        name = "" if served == model else served
        assert named == served and text == tokenizer.decode(reference[name][i]), (served, i)
    wait_idle(lora_server)
    after = adapter_counts(lora_server)
    for name in ADAPTER_SPECS:  # each adapter's own requests and tokens, counted apart from the base's
        tokens = sum(count for (served, _), (_, _, count) in zip(jobs, answers) if served == name)
        assert after[("llm_lora_output_tokens_total", name)] - before.get(("llm_lora_output_tokens_total", name), 0) \
            == tokens
        assert after[("llm_lora_requests_total", name)] - before.get(("llm_lora_requests_total", name), 0) == \
            3 * len(prompts)
    import openai

    with pytest.raises(openai.NotFoundError, match="does not exist"):
        lora_api.completions.create(model="nobody", prompt="hi", max_tokens=2)


@pytest.mark.server
def test_the_served_kv_budget_is_what_the_adapters_leave_of_kv_cache_budget_mb(lora_server, settings):
    from python_backend.lora import adapter_bytes
    from python_backend.serving.llm_adapters import DEFAULT_MAX_LORAS

    config = json.loads((Path(settings["hf_dir"]) / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    per_token = config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * head_dim * 4
    kept = 2 * DEFAULT_MAX_LORAS * adapter_bytes(BaseShapes.from_config(config), 64)  # the config's max_lora_rank
    budget = metrics(lora_server, model="llm")["llm_kv_cache_budget_bytes"]
    assert budget == (2048 * 2**20 - kept) // per_token * per_token


@pytest.mark.server
def test_the_ensemble_takes_lora_name_and_refuses_an_unknown_one(peft_run, lora_server, tokenizer):
    from scripts.clients.llm_client import GenerateClient

    _, prompts, reference = peft_run
    client = GenerateClient(f"127.0.0.1:{lora_server.http}")
    text = tokenizer.tokenizer.decode(prompts[2])
    answer = client.complete({"text_input": text, "max_tokens": MAX_TOKENS, "lora_name": "chat"})
    assert answer.text == tokenizer.decode(reference["chat"][2])
    with pytest.raises(Exception, match="LoRA adapter 'nobody' is not loaded"):
        client.complete({"text_input": text, "max_tokens": 2, "lora_name": "nobody"})


LONG = 300  # tokens: running while the adapter is unloaded (6 s at least, at the suite's SUITE_MIN_STEP_MS)


@pytest.mark.server
def test_adapters_load_and_unload_while_serving_and_a_running_request_keeps_its_adapter(peft_run, lora_server, lora_api,
                                                                                      tmp_path, rng, tokenizer,
                                                                                      settings):
    import threading

    import urllib.error
    import urllib.request

    import openai

    folder, prompts, reference = peft_run
    base_url = str(lora_api.base_url).rstrip("/")

    def post(route, body) -> tuple[int, str]:
        request = urllib.request.Request(f"{base_url}/{route}", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as error:
            return error.code, error.read().decode()

    status, text = post("load_lora_adapter", {"lora_name": "sql2", "lora_path": str(folder / "sql")})
    assert status == 200, text
    assert "sql2" in {card.id for card in lora_api.models.list().data}
    i = next(i for i, answer in enumerate(reference["sql"]) if answer != reference[""][i])  # sql's own answer
    answer = lora_api.completions.create(model="sql2", prompt=prompts[i], max_tokens=MAX_TOKENS, temperature=0)
    assert answer.choices[0].text == tokenizer.decode(reference["sql"][i])
    # a long request with sql2 (its end tokens banned), unloaded while the engine runs it: it ends with every token
    # it asked for, computed with sql2 to the end (its first tokens are sql's)
    long = {}
    thread = threading.Thread(target=lambda: long.update(answer=lora_api.completions.create(
        model="sql2", prompt=prompts[i], max_tokens=LONG, temperature=0,
        logit_bias={str(eos): -100 for eos in settings["eos_token_ids"]})))
    thread.start()
    wait_for(lambda: metrics(lora_server)["llm_running_sequences"] == 1, 120, message="the long request running")
    status, text = post("unload_lora_adapter", {"lora_name": "sql2"})
    assert status == 200, text
    assert metrics(lora_server)["llm_running_sequences"] == 1, "the long request ended before the unload"
    thread.join(300)
    done = long["answer"]
    assert done.choices[0].finish_reason == "length" and done.usage.completion_tokens == LONG
    # (banning the end token changes no token chosen before PEFT's answer ended)
    assert done.choices[0].text.startswith(tokenizer.decode(reference["sql"][i]))
    with pytest.raises(openai.NotFoundError):
        lora_api.completions.create(model="sql2", prompt="hi", max_tokens=2)
    assert post("unload_lora_adapter", {"lora_name": "sql2"})[0] == 404
    # a folder that does not fit the base: refused, naming what
    write_peft(tmp_path / "tiny", rng, 2, ("q_proj",))
    status, text = post("load_lora_adapter", {"lora_name": "tiny", "lora_path": str(tmp_path / "tiny")})
    assert status == 400 and "this base model needs" in json.loads(text)["error"]["message"], text
    assert "tiny" not in {card.id for card in lora_api.models.list().data}


@pytest.mark.server
def test_a_batch_file_names_an_adapter_per_line(peft_run, lora_api, model, tokenizer, tmp_path):
    """Through the Batch API, and through `python -m scripts.run_batch` on the same file."""
    from scripts.clients.run_batch import errors_path
    from scripts.clients.run_batch import main as run_batch

    _, prompts, reference = peft_run
    names = ["", *ADAPTER_SPECS, "nobody"]
    lines = [{"custom_id": f"{name or 'base'}-{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": name or model, "prompt": prompts[i], "max_tokens": MAX_TOKENS, "temperature": 0}}
             for name in names for i in range(len(prompts))]

    def check(records: list[dict]) -> None:
        results = {record["custom_id"]: record["response"] for record in records}
        for name in names:
            for i in range(len(prompts)):
                response = results[f"{name or 'base'}-{i}"]
                if name == "nobody":
                    assert response["status_code"] == 404, response
                else:
                    assert response["body"]["model"] == (name or model)
                    assert response["body"]["choices"][0]["text"] == tokenizer.decode(reference[name][i]), (name, i)

    uploaded = lora_api.files.create(file=("lines.jsonl", "\n".join(map(json.dumps, lines)).encode()),
                                     purpose="batch")
    batch = lora_api.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h")
    ended = ("completed", "failed", "cancelled", "expired")
    wait_for(lambda: lora_api.batches.retrieve(batch.id).status in ended, 600, 0.2, "the batch did not end")
    batch = lora_api.batches.retrieve(batch.id)
    assert batch.status == "completed", batch
    check([json.loads(raw) for file_id in (batch.output_file_id, batch.error_file_id) if file_id
           for raw in lora_api.files.content(file_id).text.splitlines()])

    source, output = tmp_path / "lines.jsonl", tmp_path / "results.jsonl"
    source.write_text("\n".join(map(json.dumps, lines)))
    run_batch(["-i", str(source), "-o", str(output), "--url", str(lora_api.base_url).rstrip("/").removesuffix("/v1")])
    check([json.loads(raw) for path in (output, errors_path(output)) if path.is_file()
           for raw in path.read_text().splitlines()])
