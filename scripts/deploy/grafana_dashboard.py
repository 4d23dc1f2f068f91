"""The Grafana dashboard for the Triton LLM server, as provisioned JSON (deploy/grafana/dashboards/triton-llm.json).

    python -m scripts.deploy.grafana_dashboard          # writes deploy/grafana/dashboards/triton-llm.json

Every query reads either a recording rule of deploy/prometheus/rules.yml or a metric that Triton's metrics port or
the supervisor's /metrics serves; tests/test_grafana_dashboard.py keeps the JSON in step with this file and
tests/test_prometheus.py runs every query against a real Prometheus scraping a real server.
"""

from __future__ import annotations

import json
import sys

from scripts.paths import PROJECT_ROOT

OUTPUT = PROJECT_ROOT / "deploy" / "grafana" / "dashboards" / "triton-llm.json"
DATASOURCE = {"type": "prometheus", "uid": "prometheus"}
WIDTH, HEIGHT = 12, 8


def panel(title: str, unit: str, *queries: tuple[str, str], kind: str = "timeseries", description: str = "") -> dict:
    """queries: (PromQL, legend)."""
    return {
        "type": kind,
        "title": title,
        "description": description,
        "datasource": DATASOURCE,
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "targets": [{"datasource": DATASOURCE, "expr": expr, "legendFormat": legend, "refId": chr(ord("A") + i)}
                    for i, (expr, legend) in enumerate(queries)],
    }


PANELS = [
    panel("Ready (supervisor)", "none", ("triton_llm_ready", "{{instance}}"), kind="stat",
          description="1 while tritonserver is ready and every model process is alive and making progress"),
    panel("Output tokens/s", "short", ("llm:output_tokens:rate1m", "{{variant}}")),
    panel("Time to first token", "s",
          ("llm:time_to_first_token_seconds:p50_5m", "p50 {{variant}}"),
          ("llm:time_to_first_token_seconds:p95_5m", "p95 {{variant}}"),
          ("llm:time_to_first_token_seconds:p99_5m", "p99 {{variant}}"),
          description="From the engine's histogram (arrival at the llm model to the first token); objective: p95 < 3 s"),
    panel("Inter-token latency", "s",
          ("llm:inter_token_latency_seconds:p50_5m", "p50 {{variant}}"),
          ("llm:inter_token_latency_seconds:p95_5m", "p95 {{variant}}")),
    panel("Engine batch size (mean sequences per decode step)", "short", ("llm:batch_size:mean_5m", "{{model}}")),
    panel("Running and waiting sequences", "short",
          ("llm_running_sequences", "running"), ("llm_waiting_sequences", "waiting"),
          ("llm_max_queue_size", "queue bound (503 beyond)")),
    panel("KV cache", "bytes", ("llm_kv_cache_bytes", "held"), ("llm_kv_cache_budget_bytes", "budget")),
    panel("Prefix cache hit rate", "percentunit", ("llm:prefix_cache_hit:ratio_5m", "{{variant}}"),
          description="Prompt tokens found in the prefix cache / prompt tokens looked up (enable_kv_cache_reuse)"),
    panel("Prefix cache", "bytes", ("llm_prefix_cache_bytes", "cached prefixes {{variant}}"),
          ("rate(llm_prefix_cache_evicted_blocks_total[5m]) * 60", "blocks evicted / min {{variant}}")),
    panel("Padding waste", "percentunit", ("llm:padding_waste:ratio_5m", "{{model}}"),
          description="Computed positions that were padding or finished rows"),
    panel("Triton queue time (mean per request)", "s", ("triton:queue_duration_seconds:mean_5m", "{{model}}")),
    panel("Requests/s", "reqps",
          ("sum by (model) (rate(nv_inference_request_success[1m]))", "ok {{model}}"),
          ("sum by (model) (rate(nv_inference_request_failure[1m]))", "failed {{model}}")),
    panel("Error rate", "percentunit", ("triton:request_errors:ratio_5m", "{{model}}"),
          description="Failed / all requests of ensemble and ensemble_unary; alert above 5 %"),
    panel("OpenAI API requests/s", "reqps",
          ("sum by (endpoint, status) (rate(openai_api_requests_total[1m]))", "{{endpoint}} {{status}}")),
    panel("OpenAI API time to response start (streams: first token)", "s",
          ("histogram_quantile(0.95, sum by (le, endpoint) (rate(openai_api_response_start_seconds_bucket[5m])))",
           "p95 {{endpoint}}")),
    panel("Batches by status (Batch API)", "short", ("sum by (status) (openai_api_batches)", "{{status}}"),
          description="Batch jobs of the OpenAI API's /v1/batches in each status"),
    panel("Batch lines and tokens/s (Batch API)", "short",
          ("sum by (result) (rate(openai_api_batch_lines_total[1m]))", "lines/s {{result}}"),
          ("rate(openai_api_batch_output_tokens_total[1m])", "output tokens/s"),
          description="Batch lines ended per second (completed: HTTP 200; failed: an error line), and their output "
                      "tokens per second; batch work runs behind live requests (priority)"),
]


def dashboard() -> dict:
    panels = []
    for i, p in enumerate(PANELS):
        panels.append({**p, "id": i + 1, "gridPos": {"x": (i % 2) * WIDTH, "y": (i // 2) * HEIGHT, "w": WIDTH,
                                                      "h": HEIGHT}})
    return {
        "uid": "triton-llm",
        "title": "Triton LLM serving",
        "tags": ["triton", "llm"],
        "timezone": "browser",
        "schemaVersion": 39,
        "refresh": "10s",
        "time": {"from": "now-30m", "to": "now"},
        "panels": panels,
    }


def queries(board: dict) -> list[str]:
    return [target["expr"] for p in board["panels"] for target in p["targets"]]


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


def main() -> int:
    OUTPUT.write_text(render())
    print(f"wrote {OUTPUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
