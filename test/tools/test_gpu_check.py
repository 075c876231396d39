"""``python tools/gpu_check.py --cpu``: the GPU check's code paths at tiny sizes on CPU, and its numbers.

The command's own consistency checks decide its exit status; this test reads the
JSON it wrote and checks the numbers again against what they must be (the minimum
reductions per FSDP group, the non-chunked program's gradients, full logits'
peak), so that a check which stopped checking fails here. The overlap analysis
of a CUDA run is exercised on synthetic profiler records.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
from tooling import REPO

sys.path.insert(0, str(REPO / "tools"))
sys.path.insert(0, str(REPO / "tools" / "bench"))


def _run(*args: str, env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "tools" / "gpu_check.py"), *args], cwd=REPO,
                          env={**os.environ, "PYTHONWARNINGS": "ignore", **(env or {})},
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-check") / "gpu-check.json"
    proc = _run("--cpu", "--out", str(out))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc.stdout, json.loads(out.read_text())


def test_cpu_form_writes_the_result_file_and_tables(cpu_run):
    stdout, data = cpu_run
    assert data["benchmark"] == "gpu_check" and data["meta"]["series"].count("+") == 1
    assert data["params"]["device"] == "cpu" and data["params"]["world_size"] == 4
    for line in ("[1/3] correctness", "[2/3] memory at scale", "[3/3] overlap and step time",
                 "| method", "Checks: "):
        assert line in stdout, line
    checks = data["results"]["checks"]
    assert checks and all(c["ok"] for c in checks), [c for c in checks if not c["ok"]]


def test_correctness_rows_at_the_minimum_with_the_non_chunked_gradients(cpu_run):
    _, data = cpu_run
    corr = data["results"]["correctness"]
    assert corr["sanitizer"] is False  # CPU: no CUDA streams to sanitize
    chunked = {(r["config"], r["head"]): r for r in corr["rows"] if r["part"] == "chunked"}
    assert set(chunked) == {(c, h) for c in ("FSDP 4", "HSDP 2x2") for h in ("separate", "grouped", "tied")}
    for (config, head), r in chunked.items():
        groups = r["groups"]
        assert groups == 4  # 2 blocks, the head's group, the root
        # One reduce-scatter per group per optimizer step (2 microbatches, reduced on the last)
        hsdp = config.startswith("HSDP")
        assert r["series"]["reductions"] == r["series"]["reduce_scatter"] == groups, (config, head, r["series"])
        assert r["series"]["all_reduce"] == (groups if hsdp else 0)
        assert 0 < r["max_grad_diff"] <= 1e-5 * r["max_grad"], (config, head, r["max_grad_diff"])
        # The counter sees more than the minimum where there is more: full logits reduces the norm of a
        # grouped head (and the root of a tied one) twice
        assert r["full"]["reduce_scatter"] == (groups if head == "separate" else groups + 1), (config, head)
    (pp,) = [r for r in corr["rows"] if r["part"] == "pp"]
    assert pp["config"].startswith("PP2 x DP2")
    # Ranks 0-1 hold the first stage (embeddings root + 2 blocks), 2-3 the last (2 blocks, head, norm root)
    assert [c["groups"] for c in pp["ranks"]] == [3, 3, 4, 4]
    assert all(c["reductions"] == c["reduce_scatter"] == c["groups"] for c in pp["ranks"]), pp["ranks"]
    assert pp["max_grad_diff"] <= 1e-5 * pp["max_grad"]


def test_memory_and_overlap_are_consistent(cpu_run):
    _, data = cpu_run
    res = data["results"]
    methods = data["params"]["methods"]
    wrappers = methods[1:-1]  # torchtitan's, released (and with the consumer series) when importable
    assert methods[0] == "full" and methods[-1] == "series" and set(wrappers) <= {"released", "patched"}
    assert ("released" in wrappers) == (importlib.util.find_spec("torchtitan") is not None)
    mem = {r["method"]: r for r in res["memory"]}
    full = mem["full"]
    # The tiny shape's logits (seq 128 x vocab 4096, bf16 + fp32 + their gradients) dominate its step
    assert full["peak_bytes"] > 4 * 128 * 4096
    for name in ("series", *wrappers):
        assert 0 < mem[name]["peak_bytes"] < full["peak_bytes"], (name, mem[name], full)
    # The series frees the head's weight before the decoder backward
    assert mem["series"]["head_weight_bytes"] == 0 and mem["series"]["blocks"] == 4
    perf = res["perf"]
    assert set(perf["times"]) == set(data["params"]["methods"])
    # The series reduces the head once per step, before the reducing microbatch's decoder backward
    assert perf["overlap"]["series"]["head_reduce_calls"] == 1
    assert perf["overlap"]["series"]["head_reduce_before_decoder_bwd"] == 1
    if wrappers:  # the released wrapper reduces the head in every microbatch
        assert perf["overlap"]["released"]["head_reduce_calls"] > 1


def test_overlap_analysis_of_device_work():
    """The CUDA half of the analysis on synthetic records: the head's reduce kernel on stream 20 runs
    from 100 to 200 ns; the decoder backward's kernels on stream 7 cover 150-180 and 190-260."""
    import gpu_check

    mark = gpu_check.MARK
    marks = [(10, 30, gpu_check.HEAD_MARK), (40, 41, f"{mark}.start.1"), (40, 41, f"{mark}.start.1"),
             (90, 91, f"{mark}.end.0")]
    ops = {1: 15, 2: 50, 3: 60, 4: 70, 5: 95}  # operator id -> start (5: after the window)
    work = [("ncclDevKernel_ReduceScatter", 100, 200, 20, 1), ("mm", 150, 180, 7, 2),
            ("mm", 190, 260, 7, 3), ("copy", 60, 65, 20, 4), ("later", 150, 400, 7, 5)]
    out = gpu_check.analyse_overlap(marks, ops, work, num_layers=2)
    assert out["head_reduce_calls"] == 1 and out["decoder_bwd_windows"] == 1
    assert out["head_reduce_before_decoder_bwd"] == 1
    assert out["compute_stream"] == 7 and out["head_streams"] == [20]
    assert out["head_reduce_kernels"] == 1 and out["head_reduce_us"] == 0.1
    assert out["overlap_us"] == pytest.approx(0.04) and out["overlap_share"] == pytest.approx(0.4)
    # Without device work (CPU): the order only
    assert set(gpu_check.analyse_overlap(marks, ops, [], num_layers=2)) == {
        "head_reduce_calls", "decoder_bwd_windows", "head_reduce_before_decoder_bwd"}


def test_head_resident_bytes_see_an_unsharded_head():
    """The memory part's head measure is not blind: the grouped head's all-gathered bf16 weights
    (lm_head and the norm's weight and bias) count while unsharded, and nothing once resharded."""
    import gpu_check
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    shape = gpu_check.SHAPES["cpu"]["scale"]
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    try:
        model = gpu_check.build_scaled(shape, gpu_check.common.make_mesh("fsdp"), torch.device("cpu"))
        assert gpu_check.head_resident(model) == (0, 0)
        model.lm_head.unshard()
        assert gpu_check.head_resident(model) == (2 * (shape["vocab"] * shape["dim"] + 2 * shape["dim"]), 0)
        model.lm_head.reshard()
        assert gpu_check.head_resident(model) == (0, 0)
    finally:
        dist.destroy_process_group()


def test_without_cuda_one_line_and_non_zero_exit(monkeypatch, capsys):
    import gpu_check

    monkeypatch.setattr(gpu_check.torch.cuda, "is_available", lambda: False)  # as on this CPU machine
    assert gpu_check.main([]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1, err
    assert err.startswith("gpu_check: no CUDA device") and "--cpu" in err
