"""The layout's rules, read from the source: no import circles (imports inside functions count), a docstring for every
package, the serving layers never import the tools around them, the serving image holds all that serving imports, and
tests/conftest.py's check of the `server` marker sees every way a test starts a tritonserver."""

from __future__ import annotations

import ast
import functools
import importlib
import re
import textwrap
from pathlib import Path

import pytest

from scripts.paths import PROJECT_ROOT

PACKAGES = ("python_backend", "scripts", "loadtests", "openai_api")


def project_modules() -> dict[str, Path]:
    modules = {}
    for package in PACKAGES:
        for path in (PROJECT_ROOT / package).rglob("*.py"):
            parts = path.relative_to(PROJECT_ROOT).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def imported_modules(path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules a file imports anywhere in it (top level, inside functions, under TYPE_CHECKING)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from package import module` imports the module; `from module import name` the module itself.
            names = [f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in modules else node.module
                     for alias in node.names]
        else:
            continue
        found.update(name for name in names if name in modules)
    return found


@functools.cache  # the source is read once for the tests that look at it (not to be changed by them)
def import_graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {name: imported_modules(path, modules) - {name} for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in graph[node]:
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        node = todo.pop()
        if node not in seen:
            seen.add(node)
            todo.extend(graph[node])
    return seen


def test_the_checker_finds_a_circle_through_an_import_inside_a_function(tmp_path):
    (tmp_path / "a.py").write_text("import b\n")
    (tmp_path / "b.py").write_text("def f():\n    from a import x\n")
    modules = {"a": tmp_path / "a.py", "b": tmp_path / "b.py"}
    graph = {name: imported_modules(path, modules) for name, path in modules.items()}
    assert cycles(graph) == [["a", "b"]]


def test_there_are_no_import_circles():
    assert cycles(import_graph()) == []


def test_every_package_says_what_it_is_for():
    for name, path in project_modules().items():
        if path.name == "__init__.py":
            assert ast.get_docstring(ast.parse(path.read_text())), f"package {name} has no docstring"


def test_the_serving_code_never_imports_the_tools_around_it():
    graph = import_graph()
    for name, imports in graph.items():
        if name.startswith("python_backend"):
            assert not {i for i in imports if not i.startswith("python_backend")}, name
        if name.startswith("openai_api"):
            assert all(i.startswith(("openai_api", "python_backend")) for i in imports), name
    engine = {name for name in graph if name.startswith("python_backend.engine")}
    runtime = {name for name in graph if name.startswith("python_backend.runtime")}
    assert not any(graph[name] & runtime for name in engine), "the engine sees decoders only through their interface"
    assert not any(graph[name] & engine for name in runtime)


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.gpu"])
def test_the_serving_image_holds_everything_the_launcher_imports(dockerfile):
    text = (PROJECT_ROOT / "docker" / dockerfile).read_text()
    copied = [Path(p) for line in re.findall(r"^COPY (.+) \S+$", text, re.M) for p in line.split()]
    graph = import_graph()
    modules = project_modules()
    entry = re.search(r'"-m", "([\w.]+)"', text).group(1)
    needed = reachable(graph, entry)
    needed |= {name.rsplit(".", depth)[0] for name in needed for depth in range(1, name.count(".") + 1)}  # packages
    for name in needed:
        source = modules[name].relative_to(PROJECT_ROOT)
        assert any(source == c or c in source.parents for c in copied), f"{dockerfile} lacks {source} ({entry})"
    assert not any(str(c).startswith(("loadtests", "tests")) for c in copied), "the serving image copies tests"


def test_the_server_marker_check_sees_a_server_started_directly_or_through_a_helper(tmp_path, monkeypatch):
    import conftest

    (tmp_path / "uses_servers.py").write_text(textwrap.dedent("""
        import subprocess, sys

        def in_a_block():
            with running_server(log_path="server.log") as ports:
                return ports

        def helper():
            return in_a_block()

        def through_a_helper():
            return helper().http

        def serve_command():
            return subprocess.Popen([sys.executable, "-m", "scripts.launcher.triton_server", "--http-port", "1"])

        def the_sweep():
            return subprocess.run([sys.executable, "-m", "loadtests.sweep", "--quick"])

        def openai_api():
            with running_openai_api("127.0.0.1:1", "model", "api.log") as url:
                return url

        def serve_command_with_a_stand_in():
            return subprocess.Popen([sys.executable, "-m", "scripts.launcher.triton_server", "--tritonserver",
                                     "./stand-in", "--http-port", "1"])

        def a_command_line_read_from_a_file(args):
            return args[:3] == ["python3", "-m", "scripts.launcher.triton_server"]
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("uses_servers")
    functions = [name for name in vars(module) if callable(getattr(module, name)) and name[0].islower()]
    assert {name for name in functions if conftest._starts_a_server(getattr(module, name))} == {
        "in_a_block", "helper", "through_a_helper", "serve_command", "the_sweep", "openai_api"}
