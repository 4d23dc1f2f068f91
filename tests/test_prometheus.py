"""deploy/prometheus/ checked with Prometheus' own tools: promtool validates the config and the rules and runs the
alerts' unit tests (rules_test.yml); a real Prometheus scrapes a real tritonserver's metrics port and finds every
metric the rules read, the recording rules give series, and so does every query of the Grafana dashboard. Skipped where Debian's `prometheus` package is not
installed (`apt-get install prometheus`; .ci/run installs it)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request

import pytest
import yaml

from scripts.deploy import grafana_dashboard
from scripts.clients.llm_client import GenerateClient
from scripts.launcher.processes import Ports, terminate
from scripts.paths import PROJECT_ROOT

PROMETHEUS_DIR = PROJECT_ROOT / "deploy" / "prometheus"
NEEDS = "needs Debian's prometheus package (apt-get install prometheus), which .ci/run installs"
# Series that come from elsewhere than Triton's metrics port: the supervisor's /metrics (checked against a supervised
# server in tests/test_recovery.py) and the OpenAI API's (tests/test_openai_api.py, tests/test_batch_api.py).
NOT_FROM_TRITON = {"triton_llm_ready", "openai_api_requests_total", "openai_api_response_start_seconds_bucket",
                   "openai_api_batches", "openai_api_batch_lines_total", "openai_api_batch_output_tokens_total"}

promtool = pytest.mark.skipif(shutil.which("promtool") is None, reason=NEEDS)


def rule_metric_names() -> set[str]:
    groups = yaml.safe_load((PROMETHEUS_DIR / "rules.yml").read_text())["groups"]
    expressions = " ".join(rule["expr"] for group in groups for rule in group["rules"])
    return set(re.findall(r"\b((?:llm|nv|triton_llm)_[a-z_]+)\b", expressions))


@promtool
@pytest.mark.parametrize("command", [["check", "config", "prometheus.yml"], ["check", "rules", "rules.yml"],
                                     ["test", "rules", "rules_test.yml"]])
def test_promtool(command):
    result = subprocess.run(["promtool", *command], cwd=PROMETHEUS_DIR, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_rules_read_the_engine_and_triton_metrics():
    names = rule_metric_names()
    assert {"llm_time_to_first_token_seconds_bucket", "llm_kv_cache_budget_bytes", "llm_max_queue_size",
            "nv_inference_request_failure", "nv_inference_queue_duration_us", "triton_llm_ready"} <= names


def query(url: str, promql: str) -> list[dict]:
    with urllib.request.urlopen(f"{url}/api/v1/query?query={urllib.parse.quote(promql)}", timeout=10) as response:
        return json.loads(response.read())["data"]["result"]


@pytest.mark.server
@pytest.mark.skipif(shutil.which("prometheus") is None, reason=NEEDS)
def test_a_real_prometheus_scrapes_every_metric_the_rules_use(server, tmp_path):
    GenerateClient(f"127.0.0.1:{server.http}").complete({"text_input": "Hi", "max_tokens": 4})
    shutil.copy(PROMETHEUS_DIR / "rules.yml", tmp_path / "rules.yml")
    config = (PROMETHEUS_DIR / "prometheus.yml").read_text()
    config = config.replace("triton:8002", f"127.0.0.1:{server.metrics}").replace("5s", "1s").replace("15s", "1s")
    (tmp_path / "prometheus.yml").write_text(config)
    port = Ports.free().http
    url = f"http://127.0.0.1:{port}"
    with open(tmp_path / "prometheus.log", "w") as log:
        process = subprocess.Popen(["prometheus", f"--config.file={tmp_path / 'prometheus.yml'}",
                                    f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                                   stdout=log, stderr=subprocess.STDOUT)
    try:
        wanted = rule_metric_names() - NOT_FROM_TRITON
        groups = yaml.safe_load((PROMETHEUS_DIR / "rules.yml").read_text())["groups"]
        recorded = {rule["record"] for group in groups for rule in group["rules"] if "record" in rule}
        missing = wanted | recorded
        deadline = time.monotonic() + 120
        while missing and time.monotonic() < deadline:
            time.sleep(1)
            try:
                scraped = {r["metric"]["__name__"] for r in query(url, 'count by (__name__) ({__name__=~".+"})')}
            except OSError:
                continue
            missing = (wanted | recorded) - scraped
        assert not missing, f"not scraped or recorded within 120 s: {sorted(missing)}; see {tmp_path / 'prometheus.log'}"
        assert query(url, 'up{job="triton"}')[0]["value"][1] == "1"
        for expr in grafana_dashboard.queries(grafana_dashboard.dashboard()):
            if not set(NOT_FROM_TRITON) & set(re.findall(r"[a-z_]+", expr)):
                assert query(url, expr), f"the dashboard's query {expr!r} gave no series"
        limits = {r["metric"]["__name__"]: float(r["value"][1])
                  for r in query(url, '{__name__=~"llm_max_queue_size|llm_kv_cache_budget_bytes"}')}
        assert limits["llm_max_queue_size"] == 256 and limits["llm_kv_cache_budget_bytes"] > 0
    finally:
        terminate(process, 10)
