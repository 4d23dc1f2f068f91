"""The provisioned Grafana dashboard: in step with its generator, and every query reads a recording rule of
deploy/prometheus/rules.yml or a metric the server exports (a real Prometheus runs each query in
tests/test_prometheus.py)."""

from __future__ import annotations

import json
import re

import yaml

from scripts.deploy import grafana_dashboard
from scripts.paths import PROJECT_ROOT

PROVISIONING = PROJECT_ROOT / "deploy" / "grafana" / "provisioning"


def test_the_committed_json_is_what_the_generator_writes():
    assert grafana_dashboard.OUTPUT.read_text() == grafana_dashboard.render(), "run python -m scripts.deploy.grafana_dashboard"


def test_every_query_reads_a_recording_rule_or_an_exported_metric():
    groups = yaml.safe_load((PROJECT_ROOT / "deploy" / "prometheus" / "rules.yml").read_text())["groups"]
    recorded = {rule["record"] for group in groups for rule in group["rules"] if "record" in rule}
    exported = set(re.findall(r'make\("(llm_[a-z_]+)"', (PROJECT_ROOT / "python_backend" / "serving" / "triton_metrics.py")
                              .read_text())) | {"triton_llm_ready", "nv_inference_request_success",
                                                "nv_inference_request_failure", "openai_api_requests_total",
                                                "openai_api_response_start_seconds_bucket", "openai_api_batches",
                                                "openai_api_batch_lines_total", "openai_api_batch_output_tokens_total"}
    for expr in grafana_dashboard.queries(grafana_dashboard.dashboard()):
        bare = re.sub(r"\[[^\]]*\]|\{[^}]*\}|by \([^)]*\)", "", expr)  # no ranges, matchers, groupings
        names = set(re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", bare)) - {"sum", "rate", "histogram_quantile"}
        assert names and names <= recorded | exported, (expr, names - recorded - exported)


def test_the_dashboard_shows_what_an_operator_needs():
    queries = " ".join(grafana_dashboard.queries(grafana_dashboard.dashboard()))
    for needed in ("time_to_first_token", "inter_token_latency", "output_tokens", "batch_size", "running_sequences",
                   "waiting_sequences", "kv_cache_bytes", "kv_cache_budget_bytes", "padding_waste", "queue_duration",
                   "request_success", "request_errors", "openai_api_requests", "openai_api_response_start",
                   "openai_api_batches", "openai_api_batch_lines", "openai_api_batch_output_tokens"):
        assert needed in queries, needed


def test_provisioning_points_grafana_at_the_dashboard_and_prometheus():
    datasource = yaml.safe_load((PROVISIONING / "datasources" / "prometheus.yml").read_text())["datasources"][0]
    assert datasource["uid"] == grafana_dashboard.DATASOURCE["uid"] and datasource["url"] == "http://prometheus:9090"
    provider = yaml.safe_load((PROVISIONING / "dashboards" / "triton-llm.yml").read_text())["providers"][0]
    assert provider["options"]["path"] == "/var/lib/grafana/dashboards"
    assert json.loads(grafana_dashboard.OUTPUT.read_text())["uid"] == "triton-llm"
