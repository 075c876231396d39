# Owner(s): ["oncall: distributed"]
"""
A pipeline step and parameter gradients across metadata inference: the
probe's gradients never reach the parameters.

The model, schedules and test base here are shared with the tests of the
later changes: test_pipelining_fsdp_policy.py (the caller's FSDP policy),
test_pipelining_fsdp_shared_params.py (tied weights across an eval()),
test_pipelining_fsdp_eval.py (evaluation steps), test_pipelining_fsdp_retry.py
and test_pipelining_fsdp_failure.py (failed steps), and
test_pipelining_fsdp_eval_grads.py (eval() of single-stage schedules).

Gloo on CPU; gradients are compared with a single-process reference over
several optimizer steps.
"""

import copy
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
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
MICROBATCH_SIZE = 2
BATCH = NUM_MICROBATCHES * MICROBATCH_SIZE
LR = 0.1
# A process group timeout short enough that a hang fails the test quickly,
# and the time within which a rank must fail after its peer failed
PG_TIMEOUT_S = 20
FAST_FAILURE_S = 5.0
# The last stage raises in its third loss call (microbatch 2)
FAIL_AT_LOSS = 3

# name: (schedule class, stages per rank)
SCHEDULES = {
    "gpipe": (ScheduleGPipe, 1),
    "1f1b": (Schedule1F1B, 1),
    "interleaved_1f1b": (ScheduleInterleaved1F1B, 2),
    "looped_bfs": (ScheduleLoopedBFS, 2),
    "interleaved_zb": (ScheduleInterleavedZeroBubble, 2),
    "zbv": (ScheduleZBVZeroBubble, 2),
    "dualpipev": (ScheduleDualPipeV, 2),
}
V_SCHEDULES = ("zbv", "dualpipev")


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x))


class StageModule(nn.Module):
    """Two blocks; ``aux`` is a head that only the loss function uses."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(Block(), Block())
        self.aux = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


def aux_backward(aux: nn.Module, out: torch.Tensor, scale: float = 1.0) -> None:
    """The auxiliary term a loss function runs backward for itself."""
    if torch.is_grad_enabled():
        (aux(out.detach()).pow(2).sum() * scale / BATCH).backward()


class Failure(Exception):
    pass


class _Base(GlooMultiProcessTestCase):
    # Helpers -------------------------------------------------------------

    def _build(
        self,
        schedule: str,
        dp: str,
        aux_loss: bool = False,
        static_metadata: bool = False,
        **sched_kwargs,
    ):
        """Stages of this rank, their schedule, the reference model and the
        map from stage modules to reference modules."""
        schedule_cls, per_rank = SCHEDULES[schedule]
        pp_size, pp_rank, pp_group, mesh = self._meshes(dp)
        num_stages = pp_size * per_rank
        torch.manual_seed(0)
        reference = nn.ModuleList([StageModule() for _ in range(num_stages)])
        if schedule in V_SCHEDULES:
            stage_ids = [pp_rank, num_stages - 1 - pp_rank]
        else:
            stage_ids = [pp_rank + i * pp_size for i in range(per_rank)]
        stages, modules = [], {}
        for idx in stage_ids:
            module = copy.deepcopy(reference[idx])
            if dp == "fsdp":
                for block in module.blocks:
                    fully_shard(block, mesh=mesh)
                fully_shard(module, mesh=mesh)
            elif dp == "replicate":
                replicate(module, mesh=mesh)
            elif dp == "children":
                for block in module.blocks:
                    fully_shard(block, mesh=mesh)
            modules[idx] = module
            # Static metadata: the stage runs no metadata inference
            static = {}
            if static_metadata:
                static = {
                    "input_args": torch.empty(MICROBATCH_SIZE, DIM, requires_grad=idx > 0),
                    "output_args": torch.empty(MICROBATCH_SIZE, DIM, requires_grad=True),
                }
            stages.append(
                PipelineStage(
                    module,
                    idx,
                    num_stages,
                    torch.device("cpu"),
                    **static,
                    group=pp_group,
                )
            )
        last = num_stages - 1

        def loss_fn(out, target):
            if aux_loss:
                aux_backward(modules[last].aux, out)
            return F.mse_loss(out, target)

        if per_rank == 1:
            sched = schedule_cls(stages[0], NUM_MICROBATCHES, loss_fn=loss_fn, **sched_kwargs)
        else:
            sched = schedule_cls(stages, NUM_MICROBATCHES, loss_fn=loss_fn, **sched_kwargs)
        self.modules, self.reference, self.last = modules, reference, last
        self.aux_loss = aux_loss
        return sched

    def _meshes(self, dp: str):
        """``(pp_size, pp_rank, pp_group, data-parallel mesh)``: one stage
        rank per rank, data parallelism of degree 1."""
        mesh = (
            init_device_mesh("cpu", (self.world_size, 1), mesh_dim_names=("pp", "dp"))["dp"]
            if dp != "none"
            else None
        )
        return self.world_size, self.rank, None, mesh

    def _data(self, seed: int):
        gen = torch.Generator().manual_seed(seed)
        return torch.randn(BATCH, DIM, generator=gen), torch.randn(BATCH, DIM, generator=gen)

    def _run_step(self, sched, x, y, **kwargs):
        if 0 in self.modules:
            return sched.step(x, target=y if self.last in self.modules else None, **kwargs)
        return sched.step(target=y if self.last in self.modules else None, **kwargs)

    def _reference_grads(self, batches) -> None:
        """Accumulate the reference gradients of ``batches`` as the pipeline
        does (mean loss per microbatch, divided by the number of microbatches)."""
        for x, y in batches:
            for xm, ym in zip(x.chunk(NUM_MICROBATCHES), y.chunk(NUM_MICROBATCHES)):
                h = xm
                for module in self.reference:
                    h = module(h)
                if self.aux_loss:
                    # The pipeline divides every gradient by the number of
                    # microbatches
                    aux_backward(self.reference[self.last].aux, h, 1 / NUM_MICROBATCHES)
                (F.mse_loss(h, ym) / NUM_MICROBATCHES).backward()

    def _assert_grads_match(self, msg: str) -> None:
        for idx, module in self.modules.items():
            ref = self.reference[idx]
            for (name, p), p_ref in zip(module.named_parameters(), ref.parameters()):
                grad = p.grad
                if isinstance(grad, DTensor):
                    grad = grad.full_tensor()
                ref_grad = p_ref.grad
                if ref_grad is None:
                    self.assertIsNone(grad, msg=f"{msg}: stage {idx} {name}")
                    continue
                self.assertIsNotNone(grad, msg=f"{msg}: stage {idx} {name}")
                # float32 rounding grows with the gradient's magnitude (sums
                # over microbatches reach |g| ~ 20 here): an absolute tolerance
                # of 5e-6 of the largest entry; the bugs tested are ~1e-1
                atol = max(1e-5, 5e-6 * ref_grad.abs().max().item())
                self.assertEqual(grad, ref_grad, atol=atol, rtol=1e-4,
                                 msg=f"{msg}: stage {idx} {name}")

    def _optimizer_step(self) -> None:
        with torch.no_grad():
            for module in self.modules.values():
                for p in module.parameters():
                    if p.grad is not None:
                        p.sub_(p.grad * LR)
                    p.grad = None
            # Every stage of the reference, also those on other ranks
            for p_ref in self.reference.parameters():
                if p_ref.grad is not None:
                    p_ref.sub_(p_ref.grad * LR)
                p_ref.grad = None

    def _build_tied(self, schedule: str, dp: str, tie: bool = True, scale_grads: bool = False):
        schedule_cls, per_rank = SCHEDULES[schedule]
        pp_size, pp_rank, pp_group, mesh = self._meshes(dp)
        num_stages = pp_size * per_rank
        torch.manual_seed(0)
        reference = nn.ModuleList([TiedStageModule() for _ in range(num_stages)])
        for idx in range(pp_size, num_stages if tie else 0):
            reference[idx].shared = reference[idx - pp_size].shared
        # One copy of the whole model keeps the ties
        model = copy.deepcopy(reference)
        stage_ids = [pp_rank + i * pp_size for i in range(per_rank)]
        stages, modules = [], {}
        for idx in stage_ids:
            module = model[idx]
            if dp != "none":
                for block in module.blocks:
                    fully_shard(block, mesh=mesh)
            if dp == "fsdp":
                # A tied layer stays out of FSDP: each stage module is its own
                # FSDP root and cannot shard a parameter another root holds;
                # untied, it is in the root's group
                ignored = set(module.shared.parameters()) if tie else None
                fully_shard(module, mesh=mesh, ignored_params=ignored)
            modules[idx] = module
            stages.append(
                PipelineStage(module, idx, num_stages, torch.device("cpu"), group=pp_group)
            )
        self.modules, self.reference, self.last = modules, reference, num_stages - 1
        self.aux_loss = False
        target = stages if per_rank > 1 else stages[0]
        return schedule_cls(target, NUM_MICROBATCHES, loss_fn=F.mse_loss, scale_grads=scale_grads)

    def _tied_grads(self) -> list:
        tied = self.modules[self.rank].shared
        return [None if p.grad is None else p.grad.clone() for p in tied.parameters()]

    def _inject_failures(self, sched, sync):
        """Make the last stage's loss raise at microbatch 0 and stage 0's
        forward at microbatch 1 while ``fail["armed"]``; with a ``sync``
        store, stage 0 raises only after the last stage has received
        microbatch 0 (so that its send is complete)."""
        loss_fn = sched._loss_fn
        fail = {"armed": False, "forward": 0, "loss": 0}

        def failing_loss(out, target):
            if fail["armed"]:
                if sync is not None:
                    sync.set("received", "1")
                raise Failure("injected loss failure")
            return loss_fn(out, target)

        def failing_forward_hook(module, args):
            if not fail["armed"]:
                fail["forward"] = 0
                return
            fail["forward"] += 1
            if fail["forward"] == 2:
                fail["forward"] = 0
                if sync is not None:
                    sync.wait(["received"])
                    sync.delete_key("received")
                    # The last stage received microbatch 0: its send
                    # completes
                    time.sleep(0.2)
                raise Failure("injected forward failure")

        sched._loss_fn = failing_loss
        first = self.modules.get(0)
        if first is not None:
            first.register_forward_pre_hook(failing_forward_hook)
        return first, fail


class TestPipelineStepWorld2(_Base):
    @property
    def world_size(self) -> int:
        return 2

    @parametrize("schedule", ["gpipe", "1f1b", "interleaved_1f1b", "zbv", "dualpipev", "looped_bfs"])
    def test_probe_gradients_do_not_reach_parameters(self, schedule: str):
        """Finding 7 (a 2.15.0 bug): a plain stage whose loss runs its own
        backward keeps no gradient from the metadata inference probe."""
        sched = self._build(schedule, "none", aux_loss=True)
        for it in range(2):
            x, y = self._data(it)
            self._run_step(sched, x, y)
            self._reference_grads([(x, y)])
            self._assert_grads_match(f"{schedule} step {it}")
            self._optimizer_step()


class TiedStageModule(nn.Module):
    """Two blocks and a ``shared`` layer that the forward applies last; the
    builder ties ``shared`` across stages placed on the same rank."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(Block(), Block())
        self.shared = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(x)
        return x + torch.tanh(self.shared(x))


instantiate_parametrized_tests(TestPipelineStepWorld2)


if __name__ == "__main__":
    run_tests()
