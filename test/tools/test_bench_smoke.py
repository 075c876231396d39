"""Smoke test of the benchmarks in tools/bench: each script runs at a tiny size,
writes its result file, and render.py turns the files into the block of docs/benchmarks.md.

A benchmark is not a test: nothing here looks at timings or counts, only that
every script runs, records where it ran, and that rendering is a pure function
of the result files. Scripts that need torch run with the interpreter running
pytest (the test venv has the patched torch); torchtitan comparisons are left
out (``--no-torchtitan``) unless torchtitan is importable. The full run is
``bash tools/bench/run_all.sh`` (docs/benchmarks.md).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "tools" / "bench"
sys.path.insert(0, str(BENCH))
import render  # noqa: E402

from torch_patches import consumers  # noqa: E402
from torch_patches.series import load_series  # noqa: E402


def run(*args: str, timeout: int = 180) -> str:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.fixture(scope="module")
def results_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("bench-results")


def _meta_ok(path: Path, name: str) -> dict:
    data = json.loads(path.read_text())
    assert data["benchmark"] == name
    meta = data["meta"]
    assert re.fullmatch(r"[0-9a-f]{12}(-dirty)?|unknown", meta["commit"]) and meta["torch_patches"]
    assert isinstance(meta["load_before"], float) and meta["series"].count("+") == 1
    return data


def test_collectives_tiny(results_dir):
    out = run(str(BENCH / "collectives.py"), "--vocab", "64", "--dim", "8", "--seq", "8",
              "--layers", "1", "--microbatches", "2", "--num-chunks", "2", "--configs", "FSDP",
              "--methods", "a,c,d", "--json", str(results_dir / "collectives-patched.json"))
    assert "reduce-scatter" in out and "full logits" in out and "error" not in out
    data = _meta_ok(results_dir / "collectives-patched.json", "collectives")
    per_method = render.measured_per_group(data["results"])
    assert per_method["a"]["reduce_scatter"] == {"layer": 1, "head": 1, "root": 1}
    assert per_method["d"]["partial"] == {"reduce_scatter": {"head": 1}}  # the norm, reduced again


def test_reduce_order_tiny(results_dir):
    out = run(str(BENCH / "reduce_order.py"), "--vocab", "64", "--dim", "8", "--seq", "8",
              "--microbatches", "2", "--num-chunks", "2", "--methods", "a,c,d",
              "--json", str(results_dir / "reduce-order-patched.json"))
    assert "exposed RS per step" in out and "error" not in out
    data = _meta_ok(results_dir / "reduce-order-patched.json", "reduce_order")
    rows = {(r["head"], r["method"]): r for r in data["results"]}
    assert data["params"]["torch_series"] == rows["separate", "a"]["torch_series"]
    # A separate head's reduction is issued at the partial_backward exit, before the decoder backward
    # (revision 2 issued it last, in the root's final callback): only layers.0 and the root are exposed
    sep = rows["separate", "a"]
    assert render.order_string(sep).startswith("RS lm_head, bwd L2, RS L2, bwd L1"), render.order_string(sep)
    assert sep["head_positions"] == [{"index": 1, "blocks_started": 0}]
    assert render.exposed_per_group(sep)["exposed"] == {"layer": 1, "root": 1}
    # ... and its weight is resharded before the decoder backward, also on the no-sync microbatch
    assert sep["head_unsharded_in_decoder_bwd"] == {"reducing": 0, "other": 0, "reducing_blocks": 3,
                                                    "other_blocks": 3}
    # The tied head's weight is also the embeddings': reduced last whatever the method
    assert [p["blocks_started"] for p in rows["tied", "a"]["head_positions"]] == [3]
    tied = rows["tied", "a"]["head_unsharded_in_decoder_bwd"]
    assert tied["reducing"] == tied["reducing_blocks"] == 3 and tied["other"] == tied["other_blocks"] == 3


@pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None, reason="torchtitan is not installed")
def test_torchtitan_chunked_tiny(results_dir):
    """torchtitan's released wrapper next to the consumer series' (tools/run_tests.sh applies it)."""
    out = run(str(BENCH / "torchtitan_chunked.py"), "--steps", "2",
              "--out", str(results_dir / "torchtitan-chunked.json"))
    assert "wrote" in out, out
    data = _meta_ok(results_dir / "torchtitan-chunked.json", "torchtitan_chunked")
    assert data["params"]["command"] == "python tools/bench/torchtitan_chunked.py --steps 2"
    rows = {(r["scenario"].split(", ")[1], r["wrapper"]): r for r in data["rows"]}
    for head in ("separate head", "grouped head"):
        released, patched = rows[head, "0.3.0"], rows[head, "patched"]
        assert not released["policy_kept"] and patched["policy_kept"]
        # One reduce-scatter per group, all in the reducing microbatch; the head's first of the step
        assert patched["reduce_scatter_per_microbatch"] == [0, 4] and patched["reduce_scatter"] == 4
        assert patched["head_reduce_scatter_positions"] == [0]
        assert released["reduce_scatter"] > 4 and patched["max_grad_diff"] < 1e-6
    assert "| patched | 4 | [0, 4] | [0] |" in consumers.collective_table(data)


def test_pp_collectives_tiny(results_dir):
    out = run(str(BENCH / "pp_collectives.py"), "--schedules", "GPipe", "--json", str(results_dir / "pp-patched.json"))
    assert re.search(r"\| GPipe +\| 0 +\| 3 ", out), out
    _meta_ok(results_dir / "pp-patched.json", "pp_collectives")


def test_pp_host_calls_tiny(results_dir):
    run(str(BENCH / "pp_host_calls.py"), "--blocks", "2", "--warmup", "1",
        "--json", str(results_dir / "pp-host-calls-patched.json"))
    data = _meta_ok(results_dir / "pp-host-calls-patched.json", "pp_host_calls")
    assert data["results"]["python_calls_per_step"] > data["results"]["python_calls_per_eval"] > 0


def test_step_time_tiny(results_dir):
    extra = [] if importlib.util.find_spec("torchtitan") else ["--no-torchtitan"]
    out = run(str(BENCH / "step_time.py"), "--vocab", "64", "--dim", "8", "--layers", "1",
              "--seq", "8", "--microbatches", "2", "--num-chunks", "2", "--warmup", "1",
              "--steps", "1", *extra, "--json", str(results_dir / "step_time.json"))
    assert "median ms/step" in out
    _meta_ok(results_dir / "step_time.json", "step_time")


def test_memory_tiny(results_dir):
    out = run(str(BENCH / "memory.py"), "--dim", "8", "--num-chunks", "2",
              "--vocab-sweep", "256x16", "--seq-sweep", "256x16", "--json", str(results_dir / "memory.json"))
    assert "chunked: peak MiB" in out
    _meta_ok(results_dir / "memory.json", "memory")


def test_wheel_build_tiny(tmp_path, results_dir):
    # A tiny stand-in wheel: only `cp` runs on it (the real comparison needs
    # the base wheel and `wheel`; run_all.sh does that)
    whl = tmp_path / "torch-0.0.0-cp311-cp311-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(whl, "w") as zf:
        zf.writestr("torch/__init__.py", "")
    out = run(str(BENCH / "wheel_build.py"), "--base", str(whl), "--repeat", "1", "--methods", "cp",
              "--json", str(results_dir / "wheel_build.json"))
    assert "| cp" in out
    _meta_ok(results_dir / "wheel_build.json", "wheel_build")


def test_compositions_tiny(results_dir):
    # One composition test without subtests; the full run is every test
    out = run(str(BENCH / "compositions.py"), "--python", sys.executable,
              "-k", "test_reentrant_checkpointing_prefetch_parity", "--json", str(results_dir / "compositions.json"))
    assert "| test_reentrant_checkpointing_prefetch_parity | 2 " in out, out
    data = _meta_ok(results_dir / "compositions.json", "compositions")
    assert data["params"]["pytest"] == {"passed": 1, "deselected": 10}
    [row] = data["results"]
    assert row["reduce_scatters_per_group_per_step"] == [1] and row["max_abs_grad_error"] < 1e-5


def test_render_is_a_pure_function_of_the_files(results_dir, tmp_path):
    """Run after the scripts above: two renders of the same files are byte-identical,
    and the README block is replaced in place (nothing outside it changes)."""
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n## Benchmarks\n\nintro\n\n{render.BEGIN}\nold\n{render.END}\n\n## Layout\n")
    for _ in range(2):
        run(str(BENCH / "render.py"), "--results", str(results_dir), "--readme", str(readme), "--no-plots")
    text = readme.read_text()
    first = text
    run(str(BENCH / "render.py"), "--results", str(results_dir), "--readme", str(readme), "--no-plots")
    assert readme.read_text() == first
    assert text.startswith("# x\n\n## Benchmarks\n\nintro\n\n") and text.endswith(f"{render.END}\n\n## Layout\n")
    assert "old" not in text and "Not measured yet: no `parity.json`" in text
    assert "**5. Scale, on paper**" in text and "| Llama-3 70B | 1024 |" in text
    assert "**1c. Reduce-scatter order" in text and "RS lm_head, bwd L2" in text
    # The smoke results come from this venv's torch, which has the shipped series applied
    rev = load_series().revision
    assert "**Exposed reduce-scatter bytes per step, on paper**" in text and f"a, rev {rev}: exposed of all RS GB" in text
    assert "**6. Compositions**" in text and "| test_reentrant_checkpointing_prefetch_parity | 2 " in text
    if (results_dir / "torchtitan-chunked.json").is_file():
        assert "**7. torchtitan's `ChunkedLossWrapper`, released vs patched**" in text
        assert "| patched | 4 | [0, 4] | [0] |" in text
    run(str(BENCH / "render.py"), "--results", str(results_dir), "--readme", str(readme), "--check")


def test_scale_arithmetic():
    groups = render.model_groups(4096, 32, 14336, 1024)
    assert groups["layer"] == (32, 218_112_000)  # attention 41.9M + MLP 176.2M + 2 norms
    assert groups["root"] == (1, 128256 * 4096)
    one_each = {"reduce_scatter": {"layer": 1, "head": 1, "root": 1}, "all_gather": {}}
    total = sum(n * c for n, c in groups.values())
    # one fp32 reduce-scatter of every parameter: (DP-1)/DP * 4 bytes * parameters (~8.03e9)
    assert render.bytes_per_step(one_each, groups, 8) == pytest.approx(7 / 8 * 4 * total)
    assert 8.0e9 < total < 8.1e9
    # The separate 70B head: 128256 x 8192 = 1.05e9 parameters, fp32, (DP-1)/DP: ~3.7 GB at DP 8
    sep = render.model_groups_separate(8192, 80, 28672, 1024)
    assert sep["head"] == (1, 128256 * 8192) and sep["root"] == (1, 128256 * 8192 + 8192)
    assert render.rs_bytes({"head": 1}, sep, 8) == pytest.approx(7 / 8 * 4 * 128256 * 8192)
    assert 3.67e9 < render.rs_bytes({"head": 1}, sep, 8) < 3.69e9


def test_docs_block_matches_committed_results():
    """The tables of docs/benchmarks.md are the committed result files, rendered (no table by hand),
    and its images resolve from docs/."""
    run(str(BENCH / "render.py"), "--check", "--no-plots")
    text = (REPO / "docs" / "benchmarks.md").read_text()
    images = re.findall(r"!\[[^]]*\]\(([^)]+)\)", text)
    assert images and all((REPO / "docs" / image).resolve().is_file() for image in images), images


def test_no_machine_specific_paths():
    offenders = []
    for path in (list((REPO / "tools").rglob("*")) + list((REPO / "torch_patches").rglob("*.py"))
                 + list((REPO / "docs").rglob("*.md")) + [REPO / "README.md"]):
        if path.is_file() and path.suffix in (".py", ".sh", ".md", ".txt", ".json"):
            text = path.read_text(errors="replace")
            offenders += [f"{path.relative_to(REPO)}: {p}" for p in ("/root/", "/home/", "/opt/wheels") if p in text]
    assert offenders == []


def test_run_all_is_valid_bash():
    subprocess.run(["bash", "-n", str(BENCH / "run_all.sh")], check=True)
