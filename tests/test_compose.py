"""docker/compose.yaml and its GPU override, checked against the project (no Docker engine here to run them): every
mounted path exists, the services find each other by the names and ports the configs use, the Locust workers can be
scaled, images are pinned, and the Locust image's pins match the project's."""

from __future__ import annotations

import re

import yaml

from scripts.paths import PROJECT_ROOT

DOCKER = PROJECT_ROOT / "docker"


def compose(name: str = "compose.yaml") -> dict:
    return yaml.safe_load((DOCKER / name).read_text())


def services() -> dict:
    return compose()["services"]


def test_the_stack_has_every_service():
    assert set(services()) == {"export", "triton", "prometheus", "grafana", "locust-master", "locust-worker"}


def test_every_bind_mount_and_build_file_exists():
    for name, service in services().items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (DOCKER / source).resolve().exists(), (name, source)
        if "build" in service:
            assert (DOCKER / service["build"]["context"] / service["build"]["dockerfile"]).is_file(), name


def test_images_are_pinned():
    for name, service in services().items():
        if "image" in service:
            assert re.fullmatch(r"[\w./-]+:[\w.-]+", service["image"]) and not service["image"].endswith(":latest"), name


def test_prometheus_scrapes_the_triton_service_on_ports_it_publishes():
    config = yaml.safe_load((PROJECT_ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    published = {int(p.rsplit(":", 1)[1]) for p in services()["triton"]["ports"]}
    for job in config["scrape_configs"]:
        for target in job["static_configs"][0]["targets"]:
            host, port = target.split(":")
            assert host == "triton" and int(port) in published, target
    assert "/etc/prometheus/prometheus.yml" in " ".join(services()["prometheus"]["command"])


def test_grafana_gets_the_provisioning_and_the_dashboard():
    mounts = dict(v.rsplit(":", 1)[0].split(":") for v in services()["grafana"]["volumes"])
    assert mounts["../deploy/grafana/provisioning"] == "/etc/grafana/provisioning"
    provider = yaml.safe_load((PROJECT_ROOT / "deploy/grafana/provisioning/dashboards/triton-llm.yml").read_text())
    assert mounts["../deploy/grafana/dashboards"] == provider["providers"][0]["options"]["path"]


def test_triton_serves_what_the_export_wrote():
    export, triton = services()["export"], services()["triton"]
    assert triton["depends_on"]["export"]["condition"] == "service_completed_successfully"
    assert "make model" in export["command"] and "/models/serve" in export["command"]
    assert triton["environment"]["TRITON_LLM_MODEL_DIR"] == "/models/serve"
    assert any(v.startswith("model:/models") for v in triton["volumes"])
    assert triton["shm_size"]  # the Python backend's shared memory


def test_locust_workers_scale_and_reach_the_master_and_the_server():
    master, worker = services()["locust-master"], services()["locust-worker"]
    assert "container_name" not in worker and "ports" not in worker, "--scale needs neither"
    assert worker["command"][worker["command"].index("--master-host") + 1] == "locust-master"
    for service in (master, worker):
        assert service["command"][service["command"].index("--host") + 1] == "http://triton:8000"


def test_the_gpu_override_serves_the_engine_it_builds_on_reserved_gpus():
    gpu = compose("compose.gpu.yaml")["services"]
    for name in ("engine", "triton"):
        devices = gpu[name]["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"], name
        assert gpu[name]["build"]["dockerfile"] == "docker/Dockerfile.gpu"
        assert (DOCKER / gpu[name]["build"]["context"] / gpu[name]["build"]["dockerfile"]).is_file()
    assert gpu["triton"]["depends_on"]["engine"]["condition"] == "service_completed_successfully"
    # The engine is built from the fp32 export (TensorRT cannot parse onnxruntime's MatMulNBits) in the model volume,
    # where the export service writes it and where the engine file goes by default (python_backend/runtime/factory.py).
    from python_backend.runtime.factory import ENGINE_FILE

    export_dir = re.search(r"EXPORT_DIR=(\S+)", services()["export"]["command"]).group(1)
    model_dir = gpu["triton"]["environment"]["TRITON_LLM_MODEL_DIR"]
    assert model_dir == export_dir
    assert f"test -f {model_dir}/{ENGINE_FILE}" in gpu["engine"]["command"]
    assert f"scripts.prepare.build_engine --model-dir {model_dir}" in gpu["engine"]["command"]
    assert set(gpu) <= set(services()) | {"engine"}


def test_the_locust_image_uses_the_projects_pins():
    pins = dict(line.split("==") for line in (PROJECT_ROOT / "requirements.txt").read_text().splitlines()
                if "==" in line and not line.startswith("#"))
    for line in (DOCKER / "requirements-locust.txt").read_text().splitlines():
        if "==" in line and not line.startswith("#"):
            name, version = line.split("==")
            assert pins.get(name) == version, name
    dockerfile = (DOCKER / "Dockerfile.locust").read_text()
    for source in re.findall(r"^COPY (\S+(?: \S+)*) \S+$", dockerfile, re.M):
        for path in source.split():
            assert (PROJECT_ROOT / path).exists(), path
