"""The model repository's configs: the two front models must not drift apart, and the interface stays
TensorRT-LLM's."""

from scripts.paths import MODEL_REPOSITORY as REPO


def config_lines(name):
    lines = (REPO / name / "config.pbtxt").read_text().splitlines()
    return [line for line in lines if line.strip() and not line.lstrip().startswith("#")]


def test_ensemble_unary_differs_from_ensemble_only_in_name_and_policy():
    ensemble, unary = config_lines("ensemble"), config_lines("ensemble_unary")
    differences = [(a, b) for a, b in zip(ensemble, unary) if a != b]
    assert len(ensemble) == len(unary)
    assert differences == [
        ('name: "ensemble"', 'name: "ensemble_unary"'),
        ("model_transaction_policy { decoupled: true }", "model_transaction_policy { decoupled: false }"),
    ]
    assert (REPO / "ensemble_unary" / "1" / "model.py").resolve() == (REPO / "ensemble" / "1" / "model.py").resolve()


def test_front_inputs_are_tensorrt_llms_names():
    text = (REPO / "ensemble" / "config.pbtxt").read_text()
    for name, kind in [("text_input", "TYPE_STRING"), ("max_tokens", "TYPE_INT32"), ("temperature", "TYPE_FP32"),
                       ("top_k", "TYPE_INT32"), ("top_p", "TYPE_FP32"), ("stop_words", "TYPE_STRING"),
                       ("end_id", "TYPE_INT32"), ("stream", "TYPE_BOOL"), ("text_output", "TYPE_STRING")]:
        assert f'name: "{name}" data_type: {kind}' in text, name


# What Triton's OpenAI frontend (python/openai/openai_frontend/engine/utils/triton.py in
# triton-inference-server/server) sends to, and reads from, a TensorRT-LLM or vLLM model, with its dtypes.
TRITON_OPENAI_FRONTEND_NAMES = [
    ("text_input", "TYPE_STRING"), ("stream", "TYPE_BOOL"), ("max_tokens", "TYPE_INT32"),
    ("stop_words", "TYPE_STRING"), ("top_p", "TYPE_FP32"), ("frequency_penalty", "TYPE_FP32"),
    ("presence_penalty", "TYPE_FP32"), ("seed", "TYPE_UINT64"), ("temperature", "TYPE_FP32"),
    ("exclude_input_in_output", "TYPE_BOOL"), ("return_num_input_tokens", "TYPE_BOOL"),
    ("return_num_output_tokens", "TYPE_BOOL"), ("text_output", "TYPE_STRING"),
    ("num_input_tokens", "TYPE_UINT32"), ("num_output_tokens", "TYPE_UINT32"),
    ("return_log_probs", "TYPE_BOOL"), ("output_log_probs", "TYPE_FP32"),
]


def test_the_ensemble_has_every_name_triton_s_openai_frontend_uses():
    text = (REPO / "ensemble" / "config.pbtxt").read_text()
    missing = [name for name, kind in TRITON_OPENAI_FRONTEND_NAMES if f'name: "{name}" data_type: {kind}' not in text]
    assert not missing
    assert "output_token_count" not in text  # replaced by num_output_tokens; nothing needs it any more


def test_the_clients_know_every_input_of_the_front_model_and_its_type():
    # The front model reads its input names from its own config; a client, which cannot read the server's files,
    # keeps its own table, checked here against the config.
    from scripts.clients.llm_client import INPUT_TYPES
    from scripts.launcher.model_config import read_config
    from tritonclient.grpc import model_config_pb2

    declared = {i.name: model_config_pb2.DataType.Name(i.data_type).removeprefix("TYPE_")
                for i in read_config(REPO / "ensemble" / "config.pbtxt").input}
    known = {name: triton_type for name, (triton_type, _) in INPUT_TYPES.items()}
    assert known == {name: "BYTES" if kind == "STRING" else kind for name, kind in declared.items()}


def test_the_configs_and_the_commands_name_one_default_model_folder():
    from python_backend.model_files import DEFAULT_MODEL_DIR
    from scripts.launcher.model_config import parameter, read_config

    for model in ("llm", "ensemble", "ensemble_unary"):
        assert parameter(read_config(REPO / model / "config.pbtxt"), "model_dir") == DEFAULT_MODEL_DIR
