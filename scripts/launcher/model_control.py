"""Reconfigure the running `llm` model without a restart: Triton's explicit model control, load with a config.

The server must run with --model-control-mode=explicit (``running_server(explicit_models=SERVED_MODELS)``)."""

from __future__ import annotations

import json

SERVED_MODELS = ["llm", "ensemble", "ensemble_unary"]


def reload_llm(http_url: str, max_batch_size: int | None = None, timeout_s: float = 300, **parameters) -> dict:
    """Loads `llm` again with these changes to its current config; the old version serves until the new is ready.
    Returns the config that was loaded."""
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(http_url, network_timeout=timeout_s, connection_timeout=timeout_s)
    config = client.get_model_config("llm")
    if max_batch_size is not None:
        config["max_batch_size"] = int(max_batch_size)
        # Triton filled in preferred_batch_size from the old max_batch_size; a larger one fails the load.
        batching = config.get("dynamic_batching", {})
        batching["preferred_batch_size"] = [s for s in batching.get("preferred_batch_size", []) if s <= max_batch_size]
    for key, value in parameters.items():
        config.setdefault("parameters", {})[key] = {"string_value": str(value)}
    client.load_model("llm", config=json.dumps(config))
    return config
