"""scripts/bench/process_cpu.py: a command's CPU by process, read from /proc while it runs."""

import sys

from scripts.bench import process_cpu


def test_the_cpu_of_a_command_and_the_processes_it_starts_is_counted_by_kind(capsys):
    """The command (a `python -c`) starts another that burns 0.8 CPU-s: both are counted, and nothing else that runs
    on the machine meanwhile. The burner then idles for 40 of the sampler's intervals, so that a reading after its
    burn comes on a loaded machine too."""
    burn = "import time\nstart = time.process_time()\nwhile time.process_time() - start < 0.8: pass\ntime.sleep(2)"
    parent = f"import subprocess, sys\nsubprocess.run([sys.executable, '-c', {burn!r}], check=True)"
    assert process_cpu.main(["--interval", "0.05", "--", sys.executable, "-c", parent]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = {line.split(" | ")[0].removeprefix("| "): line.split(" | ")[1:] for line in lines
            if line.startswith("| ") and not line.startswith(("| processes", "| ---"))}
    assert list(rows) == ["other"], rows  # two plain `python -c`
    cpu, count = float(rows["other"][0]), int(rows["other"][1].strip(" |"))
    assert count == 2 and 0.7 <= cpu < 2.0, rows


def test_each_kind_is_named_from_its_command_line():
    stub = ("/x/triton_python_backend_stub /work/model_repository/ensemble_unary/1/model.py "
            "triton_python_backend_shm_region_1 1048576")
    assert process_cpu.kind_of(stub) == "Python stubs of `ensemble_unary`"
    assert process_cpu.kind_of("/v/pytriton/tritonserver/bin/tritonserver --model-repository=/r") == "tritonserver"
    assert process_cpu.kind_of("python -u -c import sys;exec(eval(sys.stdin.readline()))") == (
        "pytest's workers (in-process tests)")
    assert process_cpu.kind_of("/bin/sleep 1") == "other"
