"""Reading Triton's metrics port (Prometheus text) and the llm model's custom metrics."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families


def read_metrics(metrics_url: str, prefix: str = "llm_", **labels: str) -> dict[str, float]:
    """Sample name -> value for samples whose name starts with prefix and whose labels include ``labels``;
    histogram buckets are left out, and samples that differ only in other labels are added up."""
    with urllib.request.urlopen(f"http://{metrics_url}/metrics", timeout=10) as response:
        text = response.read().decode()
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.name.startswith(prefix) or "le" in sample.labels:
                continue
            if all(sample.labels.get(k) == v for k, v in labels.items()):
                values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values
