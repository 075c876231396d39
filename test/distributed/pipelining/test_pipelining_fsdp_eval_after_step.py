# Owner(s): ["oncall: distributed"]
"""
``step()`` then ``eval()`` on FSDP stages keeps the step's reduced gradients.

2.15.0 sets every FSDP gradient to ``None`` at the switch from training to
evaluation: the cleanup after the metadata inference probe that ``eval()``
reruns clears the gradients of every FSDP module of the stage, so an
``eval()`` between a step and its optimizer step drops the step's FSDP
gradients (plain parameters keep theirs). The probe now keeps the gradients
it found (and drops only its own), so they are still there after
``eval()``. This test fails on 2.15.0 for every schedule and layout (with
GPipe and 1F1B, 2.15.0's ``eval()`` also divides the gradients it leaves by
the number of microbatches).

It uses only APIs that torch 2.15.0 has. Gloo on CPU; gradients are compared
with a single-process reference over several optimizer steps.
"""

import copy
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleLoopedBFS,
)
from torch.distributed.tensor import DTensor
from torch.testing._internal.common_utils import (
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
)


sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from fsdp_lifecycle_testing import GlooMultiProcessTestCase  # noqa: E402


DIM = 8
NUM_MICROBATCHES = 4
BATCH = 2 * NUM_MICROBATCHES
LR = 0.1

# name: (schedule class, stages per rank)
SCHEDULES = {
    "gpipe": (ScheduleGPipe, 1),
    "1f1b": (Schedule1F1B, 1),
    "interleaved_1f1b": (ScheduleInterleaved1F1B, 2),
    "looped_bfs": (ScheduleLoopedBFS, 2),
}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x))


class StageModule(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(DIM, DIM)
        self.blocks = nn.ModuleList([Block(), Block()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        for block in self.blocks:
            h = block(h)
        return h


class TestPipelineEvalAfterStep(GlooMultiProcessTestCase):
    @property
    def world_size(self) -> int:
        return 2

    @parametrize("schedule", list(SCHEDULES))
    @parametrize("layout", ["fsdp", "container"])
    def test_eval_keeps_the_step_gradients(self, schedule: str, layout: str):
        """step(a), eval(e), then the optimizer step: the gradients are
        ref(a) (2.15.0: None for every parameter that FSDP manages). Layouts:
        "fsdp" shards each block and the stage module; "container" shards
        each block and leaves the stage module a plain container."""
        schedule_cls, per_rank = SCHEDULES[schedule]
        num_stages = self.world_size * per_rank
        mesh = init_device_mesh("cpu", (self.world_size, 1), mesh_dim_names=("pp", "dp"))["dp"]
        # Double precision: the pipeline and the reference sum the
        # microbatches' gradients in different orders
        torch.set_default_dtype(torch.float64)
        torch.manual_seed(0)
        reference = nn.ModuleList([StageModule() for _ in range(num_stages)])
        last = num_stages - 1
        params, stages = {}, []
        for idx in (self.rank + i * self.world_size for i in range(per_rank)):
            module = copy.deepcopy(reference[idx])
            for block in module.blocks:
                fully_shard(block, mesh=mesh)
            if layout == "fsdp":
                fully_shard(module, mesh=mesh)
            # The sharded parameters, as an optimizer holds them (an FSDP root
            # registers its unsharded parameters after an eval() forward)
            params[idx] = list(module.named_parameters())
            stages.append(PipelineStage(module, idx, num_stages, torch.device("cpu")))
        target = stages[0] if per_rank == 1 else stages
        sched = schedule_cls(target, NUM_MICROBATCHES, loss_fn=F.mse_loss)

        def call(fn, data):
            x, y = data
            args = (x,) if 0 in params else ()
            return fn(*args, **({"target": y} if last in params else {}))

        for it in range(3):
            gen = torch.Generator().manual_seed(it)
            a = torch.randn(BATCH, DIM, generator=gen), torch.randn(BATCH, DIM, generator=gen)
            e = torch.randn(BATCH, DIM, generator=gen), torch.randn(BATCH, DIM, generator=gen)
            call(sched.step, a)
            with torch.no_grad():
                call(sched.eval, e)
            for xm, ym in zip(a[0].chunk(NUM_MICROBATCHES), a[1].chunk(NUM_MICROBATCHES)):
                h = xm
                for module in reference:
                    h = module(h)
                (F.mse_loss(h, ym) / NUM_MICROBATCHES).backward()
            for idx, named in params.items():
                for (name, p), p_ref in zip(named, reference[idx].parameters(), strict=True):
                    msg = f"{schedule} {layout} step {it}: stage {idx} {name}"
                    self.assertIsNotNone(p.grad, msg=msg)
                    grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                    self.assertEqual(grad, p_ref.grad, atol=1e-10, rtol=1e-8, msg=msg)
            with torch.no_grad():
                for named in params.values():
                    for _, p in named:
                        p.sub_(p.grad * LR)
                        p.grad = None
                for p_ref in reference.parameters():
                    p_ref.sub_(p_ref.grad * LR)
                    p_ref.grad = None


instantiate_parametrized_tests(TestPipelineEvalAfterStep)


if __name__ == "__main__":
    run_tests()
