"""docs/cpu.md's runnable CPU/gloo program runs as written: 2 forked gloo ranks, a CPU device
mesh, a chunked loss through the lifecycle API, and the sharded gradients checked against a
float64 single-process reference (to_local() against the reference's rows, full_tensor()
against the whole gradient)."""

import re
import subprocess
import sys

from tooling import REPO

DOC = REPO / "docs" / "cpu.md"


def program() -> str:
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
    runnable = [b for b in blocks if b.startswith("# Runs as is")]
    assert len(runnable) == 1, "docs/cpu.md has one runnable python block"
    return runnable[0]


def test_cpu_program_runs_and_matches_float64(tmp_path):
    import torch.distributed.fsdp as fsdp
    assert hasattr(fsdp.FSDPModule, "partial_backward"), \
        "the program needs the series applied to this torch (tools/run_tests.sh does that)"
    code = program()
    for needed in ('init_process_group("gloo"', 'init_device_mesh("cpu"', ".double()", ".to_local()",
                   ".full_tensor()", "partial_backward", "finish_forward"):
        assert needed in code, needed
    script = tmp_path / "cpu_example.py"
    script.write_text(code)
    proc = subprocess.run([sys.executable, script.name], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    m = re.search(r"placements \(Shard\(dim=0\),\); max \|grad - float64 reference\| = (\S+)", proc.stdout)
    assert m and float(m.group(1)) < 1e-12, proc.stdout


def test_doc_says_where_the_wheel_goes():
    text = " ".join(DOC.read_text().split())
    assert "python -m venv" in text and "fresh virtual environment" in text
    assert "builds its own `.venv`" in text and "runs on a machine without a GPU" in text


def test_readme_points_to_the_cpu_path():
    text = " ".join((REPO / "README.md").read_text().split())
    assert "fresh virtual environment" in text and "the tests build their own `.venv`" in text
    assert "runs on a CPU-only machine" in text and "[docs/cpu.md](docs/cpu.md)" in text
    assert "no idle machine was available" in text  # the figures say under what load they were taken
