"""The suite's own rules: helpers and fixtures that several files use have one home (tests/helpers.py, or
tests/conftest.py for fixtures), and no test file defines again what that home or another test file already has."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).parent
SHARED = {"helpers.py", "conftest.py"}
MIN_LINES = 4  # shorter bodies (a one-line fixture) say too little to be a copy worth sharing


def definitions(path: Path) -> dict[str, ast.AST]:
    """The top-level functions and classes of a file: name -> node."""
    tree = ast.parse(path.read_text(), filename=str(path))
    return {node.name: node for node in tree.body
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}


def body_shape(node: ast.AST) -> str | None:
    """A definition's body without its name, decorators and docstring, as ast.dump; None when it is too short to
    count as a copy."""
    body = list(node.body)
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    if not body or body[-1].end_lineno - body[0].lineno + 1 < MIN_LINES:
        return None
    arguments = ast.dump(node.args) if hasattr(node, "args") else ""
    return arguments + "".join(ast.dump(statement) for statement in body)


def suite_files() -> list[Path]:
    return sorted(TESTS.glob("test_*.py"))


def test_no_test_file_defines_a_helper_that_tests_helpers_has():
    shared_names = set(definitions(TESTS / "helpers.py"))
    again = {f"{path.name}: {name}" for path in suite_files() for name in definitions(path) if name in shared_names}
    assert not again, f"defined again beside tests/helpers.py (import it from there): {sorted(again)}"


def test_no_helper_or_fixture_body_is_copied_between_files():
    """The same body (whatever its name) in two files, or in a test file and tests/helpers.py or conftest.py: it
    belongs in one of those two."""
    seen: dict[str, str] = {}
    copies = []
    for path in [TESTS / name for name in sorted(SHARED)] + suite_files():
        for name, node in definitions(path).items():
            if name.startswith(("test_", "Test")) or (shape := body_shape(node)) is None:
                continue
            place = f"{path.name}::{name}"
            if shape in seen and seen[shape].split("::")[0] != path.name:
                copies.append(f"{place} copies {seen[shape]}")
            seen.setdefault(shape, place)
    assert not copies, "move each to tests/helpers.py (or a fixture to tests/conftest.py): " + "; ".join(copies)


def test_the_check_sees_a_copy(tmp_path):
    """The body comparison above finds a helper copied under another name, and lets a short one pass."""
    original = ("def wait_until(condition):\n    import time\n    while not condition():\n"
                "        time.sleep(0.1)\n    return True\n")
    (tmp_path / "a.py").write_text(original)
    (tmp_path / "b.py").write_text(original.replace("wait_until", "poll"))
    (tmp_path / "c.py").write_text("def short():\n    return 1\n")
    [a], [b], [c] = (definitions(tmp_path / f"{x}.py").values() for x in "abc")
    assert body_shape(a) == body_shape(b) is not None
    assert body_shape(c) is None


def test_the_longest_files_named_first_exist_and_run_first():
    from types import SimpleNamespace

    from tests.conftest import LONGEST_FIRST, longest_first

    names = {path.name for path in suite_files()}
    assert set(LONGEST_FIRST) <= names, f"renamed or removed: {set(LONGEST_FIRST) - names}"
    items = [SimpleNamespace(path=TESTS / name, order=i) for i, name in
             enumerate(["test_a.py", LONGEST_FIRST[1], "test_a.py", LONGEST_FIRST[0], LONGEST_FIRST[1]])]
    longest_first(items)
    assert [(item.path.name, item.order) for item in items] == [
        (LONGEST_FIRST[0], 3), (LONGEST_FIRST[1], 1), (LONGEST_FIRST[1], 4), ("test_a.py", 0), ("test_a.py", 2)]


def test_a_lazy_module_is_imported_by_the_test_that_uses_it_not_by_collection():
    """pytest probes every name of a file it collects (`_mock_name`, `__wrapped__`): a lazy module answers those
    without an import, so openai and Ray Data stay out of the workers that run none of their tests."""
    import importlib
    import inspect
    import sys

    from tests.helpers import lazy_module

    name = "mailbox"  # a standard module that nothing here imports
    assert name not in sys.modules
    module = lazy_module(name)
    assert getattr(module, "_mock_name", None) is None and inspect.unwrap(module) is module
    assert name not in sys.modules, "a probe imported it"
    assert module.Maildir is importlib.import_module(name).Maildir


def test_the_servers_the_suite_starts_run_with_its_step_floor():
    """tests/conftest.py sets it for every process the suite starts; the launcher passes it on to tritonserver."""
    from python_backend.runtime.fault_injection import FAULT_ENV
    from scripts.launcher.triton_server import server_environment
    from tests.helpers import SUITE_MIN_STEP_MS

    assert f"min_step_ms={SUITE_MIN_STEP_MS}" in server_environment()[FAULT_ENV].split(",")
