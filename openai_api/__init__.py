"""An OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models) in front of Triton's `ensemble`
model: ``python -m scripts.launcher.openai_server``; ``make serve`` starts it beside tritonserver."""
