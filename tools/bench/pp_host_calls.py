"""Host cost of a pipeline step: Python calls per ``step()`` and per ``eval()``.

Schedule1F1B, world 1 (one rank, gloo), one stage whose module holds
``--blocks`` fully_shard'ed blocks under a fully_shard'ed root (101 FSDP
modules by default), ``--microbatches`` microbatches. After ``--warmup``
steps and evals (metadata inference, lazy init), a ``step()`` after a step and
an ``eval()`` after an eval run under :mod:`cProfile`; the result is the number of Python
function calls each made (``pstats.Stats.total_calls``, deterministic for a
given torch): ``eval()`` both under ``torch.no_grad()`` and in grad mode (the
default call), for an FSDP stage module and for a container stage module
(the blocks fully_shard'ed, the stage module plain: ``--blocks`` roots). Run it with the pristine and with the patched torch and compare:

    python tools/bench/pp_host_calls.py --json tools/bench/results/pp-host-calls-pristine.json
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import results  # noqa: E402


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x))


def calls_of(fn) -> int:
    profile = cProfile.Profile()
    profile.enable()
    fn()
    profile.disable()
    return pstats.Stats(profile).total_calls


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", type=int, default=100, help="FSDP blocks (plus the FSDP root)")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--dim", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--json", type=Path, default=None, help="result file to write")
    args = p.parse_args()
    load_before = results.load()
    out: dict[str, int] = {}
    for layout in ("fsdp", "container"):
        out.update(measure(args, layout))
    fsdp_modules = args.blocks + 1
    print(f"torch {torch.__version__}: {args.microbatches} microbatches: {out}", file=sys.stderr)
    params = {"blocks": args.blocks, "fsdp_modules": fsdp_modules, "microbatches": args.microbatches,
              "dim": args.dim, "warmup": args.warmup, "schedule": "Schedule1F1B", "world": 1,
              "layouts": "fsdp: blocks + FSDP stage module; container: blocks only"}
    results.write(args.json, "pp_host_calls", params, out, load_before, torch.__version__)


def measure(args: argparse.Namespace, layout: str) -> dict[str, int]:
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group(
            "gloo", store=dist.FileStore(os.path.join(tmp, "store"), 1), rank=0, world_size=1
        )
        torch.manual_seed(0)
        mesh = init_device_mesh("cpu", (1,))
        model = nn.Sequential(*(Block(args.dim) for _ in range(args.blocks)))
        for block in model:
            fully_shard(block, mesh=mesh)
        if layout == "fsdp":
            fully_shard(model, mesh=mesh)
        stage = PipelineStage(model, 0, 1, torch.device("cpu"))
        sched = Schedule1F1B(stage, args.microbatches, loss_fn=F.mse_loss)
        batch = 2 * args.microbatches
        x, y = torch.randn(batch, args.dim), torch.randn(batch, args.dim)

        def step() -> None:
            sched.step(x, target=y)

        def evaluate() -> None:
            with torch.no_grad():
                sched.eval(x, target=y)

        def evaluate_grad_mode() -> None:
            sched.eval(x, target=y)

        for _ in range(args.warmup):
            step()
            evaluate()
            evaluate_grad_mode()
        # A step after a step and an eval after an eval of the same kind: no
        # metadata inference (it reruns at each switch between eval and training)
        step()
        per_step = calls_of(step)
        evaluate()
        per_eval = calls_of(evaluate)
        evaluate_grad_mode()
        per_eval_grad = calls_of(evaluate_grad_mode)
        # The evaluations above run with the steps' gradients held (no
        # zero_grad()), where 0029 reshards the FSDP roots at each eval's exit
        # so that the gradients stay visible and a later eval uses the updated
        # parameters (one more all-gather per root at the next eval); the same
        # after zero_grad(), as in a loop that evaluates after its optimizer step
        model.zero_grad(set_to_none=True)
        evaluate()
        per_eval_cleared = calls_of(evaluate)
        evaluate_grad_mode()
        per_eval_grad_cleared = calls_of(evaluate_grad_mode)
        dist.destroy_process_group()
    suffix = "" if layout == "fsdp" else "_container"
    return {
        f"python_calls_per_step{suffix}": per_step,
        f"python_calls_per_eval{suffix}": per_eval,
        f"python_calls_per_eval_grad_mode{suffix}": per_eval_grad,
        f"python_calls_per_eval_no_grads{suffix}": per_eval_cleared,
        f"python_calls_per_eval_grad_mode_no_grads{suffix}": per_eval_grad_cleared,
    }


if __name__ == "__main__":
    main()
