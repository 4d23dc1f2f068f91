"""deploy/k8s/ checked offline: every manifest, and each overlay as `kubectl kustomize` builds it, passes
kubernetes-validate (strict: unknown fields are errors) against Kubernetes 1.37's schemas; and the pieces fit the
project and each other (probes on the supervisor's endpoints, selectors, the HPA's metric, the GPU overlay)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from scripts.paths import PROJECT_ROOT

K8S = PROJECT_ROOT / "deploy" / "k8s"
BASE = K8S / "base"
kubectl = pytest.mark.skipif(shutil.which("kubectl") is None, reason="needs kubectl (for `kubectl kustomize`)")


def validate(path: Path) -> None:
    tool = Path(sys.executable).parent / "kubernetes-validate"
    result = subprocess.run([str(tool), "--strict", "--quiet", str(path)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def build(overlay: str) -> list[dict]:
    result = subprocess.run(["kubectl", "kustomize", str(K8S / "overlays" / overlay)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    return list(yaml.safe_load_all(result.stdout))


def by_kind(documents: list[dict]) -> dict[str, dict]:
    return {d["kind"]: d for d in documents}


@pytest.mark.parametrize("name", sorted(p.name for p in BASE.glob("*.yaml") if p.name != "kustomization.yaml"))
def test_each_manifest_is_valid(name):
    validate(BASE / name)


@kubectl
@pytest.mark.parametrize("overlay", ["cpu", "gpu"])
def test_each_overlay_builds_and_is_valid(overlay, tmp_path):
    documents = build(overlay)
    (tmp_path / "built.yaml").write_text(yaml.safe_dump_all(documents))
    validate(tmp_path / "built.yaml")
    assert {d["kind"] for d in documents} == {"Deployment", "Service", "PodDisruptionBudget",
                                               "HorizontalPodAutoscaler", "PersistentVolumeClaim", "NetworkPolicy"}


@kubectl
def test_the_gpu_overlay_asks_for_a_gpu_and_the_cpu_one_does_not():
    def limits(overlay):
        return by_kind(build(overlay))["Deployment"]["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]

    assert limits("gpu")["nvidia.com/gpu"] == 1 and "nvidia.com/gpu" not in limits("cpu")


@kubectl
def test_the_gpu_overlay_builds_the_engine_where_the_server_looks_for_it():
    from python_backend.runtime.factory import ENGINE_FILE

    pod = by_kind(build("gpu"))["Deployment"]["spec"]["template"]["spec"]
    [init], [server] = pod["initContainers"], pod["containers"]
    assert init["image"] == server["image"] == "triton-llm-gpu:0.1.0"
    model_dir = next(e["value"] for e in server["env"] if e["name"] == "TRITON_LLM_MODEL_DIR")
    assert f"test -f {model_dir}/{ENGINE_FILE} || python3 -m scripts.prepare.build_engine --model-dir {model_dir}" \
        in init["command"][-1]
    assert {m["mountPath"] for m in init["volumeMounts"]} == {model_dir}
    assert init["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert "initContainers" not in by_kind(build("cpu"))["Deployment"]["spec"]["template"]["spec"]


def test_the_pieces_fit_the_project_and_each_other():
    manifests = by_kind([yaml.safe_load(p.read_text()) for p in BASE.glob("*.yaml") if p.name != "kustomization.yaml"])
    deployment, service = manifests["Deployment"], manifests["Service"]
    pod = deployment["spec"]["template"]
    container = pod["spec"]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    dockerfile = (PROJECT_ROOT / "docker" / "Dockerfile").read_text()
    assert ports["health"] == int(re.search(r'"--health-port", "(\d+)"', dockerfile).group(1))
    assert container["readinessProbe"]["httpGet"] == {"path": "/health/ready", "port": "health"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/health/live", "port": "health"}
    assert any(m["mountPath"] == "/dev/shm" for m in container["volumeMounts"])
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert any(m["mountPath"] == env["TRITON_LLM_MODEL_DIR"] for m in container["volumeMounts"])
    batch_dir = re.search(r"ENV TRITON_LLM_BATCH_DIR=(\S+)", dockerfile).group(1)
    assert any(m["mountPath"] == batch_dir for m in container["volumeMounts"]), "the Batch API's state on a volume"
    keys_file = Path(env["TRITON_LLM_API_KEYS_FILE"])
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == str(keys_file.parent))
    secret = next(v for v in pod["spec"]["volumes"] if v["name"] == mount["name"])["secret"]
    assert secret["optional"] is True, "API keys come from a Secret, mounted as a file"
    labels = pod["metadata"]["labels"]
    for selector in (service["spec"]["selector"], manifests["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"],
                     deployment["spec"]["selector"]["matchLabels"]):
        assert selector.items() <= labels.items()
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= set(ports)
    hpa = manifests["HorizontalPodAutoscaler"]
    assert hpa["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    metric = hpa["spec"]["metrics"][0]["pods"]["metric"]["name"]
    assert f'make("{metric}"' in (PROJECT_ROOT / "python_backend" / "serving" / "triton_metrics.py").read_text()
    adapter = yaml.safe_load((K8S / "prometheus-adapter-rules.yaml").read_text())
    assert adapter["rules"][0]["name"]["matches"] == metric
