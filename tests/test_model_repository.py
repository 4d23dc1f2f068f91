"""The model repository's configs: the two front models must not drift apart, and the interface stays
TensorRT-LLM's."""

from scripts.triton_server import DEFAULT_MODEL_REPOSITORY as REPO


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
