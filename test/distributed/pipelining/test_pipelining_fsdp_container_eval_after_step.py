# Owner(s): ["oncall: distributed"]
"""
``step()`` then ``eval()`` keeps the step's gradients visible on a stage
module whose FSDP roots stay unsharded after a forward: a plain container of
``fully_shard``'ed blocks (each block is an FSDP root), and an FSDP stage
module (the root) that holds a parameter of its own.

FSDP keeps a root unsharded after its forward, with the unsharded parameters
registered, until a backward or a reshard. ``eval()`` runs no backward, so
after ``step()``, ``eval()`` the stage module's ``parameters()`` were the
roots' unsharded parameters, whose ``.grad`` is ``None``: code that reads the
gradients through the module before the optimizer step (gradient clipping,
logging) missed the step's gradients, and an ``eval()`` after the optimizer
step computed with the roots' parameters from before it. An evaluation step
now reshards the roots that held gradients at its entry.

Container stages: GPipe, 1F1B and Interleaved1F1B (two stages per rank);
FSDP stage modules: GPipe and 1F1B (the schedules with several stages per
rank reshard them already); ``eval()``
in grad mode, in grad mode with a loss that runs its own backward (its
gradients add to the step's, as on 2.15.0), and under ``torch.no_grad()``.
Gradients read through the stage modules and the next ``eval()``'s losses are
compared with a float64 single-process reference over several optimizer
steps. It uses only APIs that torch 2.15.0 has; it fails on 2.15.0 (which
also drops the step's gradients at the switch to evaluation) and on the
series without the fix.
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
PP = 2
DP = 2
NUM_MICROBATCHES = 4
BATCH = 2 * NUM_MICROBATCHES
LR = 0.1
STEPS = 3

# name: (schedule class, stages per rank)
SCHEDULES = {
    "gpipe": (ScheduleGPipe, 1),
    "1f1b": (Schedule1F1B, 1),
    "interleaved_1f1b": (ScheduleInterleaved1F1B, 2),
}
# (grad mode of the eval() between the step and the optimizer step, loss)
EVALS = [("grad", "plain"), ("grad", "own_backward"), ("no_grad", "plain")]


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x))


class StageModule(nn.Module):
    """A projection and two blocks; the last stage also holds the head, which
    the loss runs."""

    def __init__(self, last: bool) -> None:
        super().__init__()
        self.proj = nn.Linear(DIM, DIM)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(DIM, DIM) if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj(x)
        for block in self.blocks:
            x = block(x)
        return x


def _data(it: int, dp_rank: int, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * offset + 10 * it + dp_rank)
    return torch.randn(BATCH, DIM, generator=gen), torch.randn(BATCH, DIM, generator=gen)


class TestPipelineContainerEvalAfterStep(GlooMultiProcessTestCase):
    @property
    def world_size(self) -> int:
        return PP * DP

    @parametrize("schedule", list(SCHEDULES))
    def test_eval_keeps_the_step_gradients_visible(self, schedule: str):
        """Container stages; see :meth:`_check_schedule`."""
        self._check_schedule(schedule, "container")

    @parametrize("schedule", ["gpipe", "1f1b"])
    def test_eval_keeps_the_fsdp_root_gradients_visible(self, schedule: str):
        """FSDP stage modules whose root holds ``proj`` itself; see
        :meth:`_check_schedule`."""
        self._check_schedule(schedule, "fsdp")

    def _check_schedule(self, schedule: str, kind: str) -> None:
        """Per eval kind: STEPS times step(a), eval(e), the gradients read
        through the stage modules (ref(a), plus the head's gradient of e if
        the loss runs its own backward), the optimizer step, then
        eval(e) under no_grad, whose losses are the reference's with the
        updated parameters (2.15.0 and the series without the fix: every
        root's gradient None through the module, and the second eval()
        computes with the roots' parameters from before the optimizer
        step)."""
        # Double precision: the pipeline and the reference sum the
        # microbatches' gradients in different orders
        torch.set_default_dtype(torch.float64)
        mesh = init_device_mesh("cpu", (PP, DP), mesh_dim_names=("pp", "dp"))
        for grad_mode, loss in EVALS:
            self._check_eval_kind(mesh, schedule, kind, grad_mode, loss)

    def _check_eval_kind(
        self, mesh, schedule: str, kind: str, grad_mode: str, loss_kind: str
    ) -> None:
        schedule_cls, per_rank = SCHEDULES[schedule]
        num_stages = PP * per_rank
        last = num_stages - 1
        pp_rank = mesh["pp"].get_local_rank()
        dp_rank = mesh["dp"].get_local_rank()
        torch.manual_seed(0)
        reference = nn.ModuleList(
            [StageModule(idx == last) for idx in range(num_stages)]
        )
        modules, stages = {}, []
        for idx in (pp_rank + i * PP for i in range(per_rank)):
            module = copy.deepcopy(reference[idx])
            for block in module.blocks:
                fully_shard(block, mesh=mesh["dp"])
            if module.head is not None:
                fully_shard(module.head, mesh=mesh["dp"])
            if kind == "container":
                # The stage module stays a plain container of FSDP modules
                fully_shard(module.proj, mesh=mesh["dp"])
            else:
                # The stage module is the FSDP root and holds proj itself
                fully_shard(module, mesh=mesh["dp"])
            modules[idx] = module
            stages.append(
                PipelineStage(
                    module, idx, num_stages, torch.device("cpu"), group=mesh["pp"].get_group()
                )
            )
        optim = torch.optim.SGD(
            [p for module in modules.values() for p in module.parameters()], lr=LR
        )

        def loss_fn(h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            head = modules[last].head
            if loss_kind == "plain" or not (torch.is_grad_enabled() and h.requires_grad):
                return F.mse_loss(head(h), y)
            # Runs the head's backward itself; returns a surrogate whose
            # backward gives the blocks' gradients
            h_detached = h.detach().requires_grad_(True)
            loss = F.mse_loss(head(h_detached), y)
            loss.backward()
            surrogate = (h * h_detached.grad).sum()
            return surrogate - surrogate.detach() + loss.detach()

        target = stages[0] if per_rank == 1 else stages
        sched = schedule_cls(target, NUM_MICROBATCHES, loss_fn=loss_fn)

        def call(fn, data, losses=None):
            x, y = data
            args = (x,) if 0 in modules else ()
            kwargs = {"target": y, "losses": losses} if last in modules else {}
            return fn(*args, **kwargs)

        def ref_losses(data):
            losses = []
            for xm, ym in zip(data[0].chunk(NUM_MICROBATCHES), data[1].chunk(NUM_MICROBATCHES)):
                h = xm
                for module in reference:
                    h = module(h)
                losses.append(F.mse_loss(reference[last].head(h), ym))
            return losses

        for it in range(STEPS):
            call(sched.step, _data(it, dp_rank, 1))
            evaluation = _data(it, dp_rank, 2)
            if grad_mode == "grad":
                call(sched.eval, evaluation)
            else:
                with torch.no_grad():
                    call(sched.eval, evaluation)
            # The reference: the mean over microbatches, averaged over the
            # data-parallel ranks; a loss that runs its own backward in a
            # grad-mode eval() adds the head's gradients of e (unscaled)
            for d in range(DP):
                for loss in ref_losses(_data(it, d, 1)):
                    (loss / (NUM_MICROBATCHES * DP)).backward()
            if grad_mode == "grad" and loss_kind == "own_backward":
                head = reference[last].head
                for d in range(DP):
                    for loss in ref_losses(_data(it, d, 2)):
                        grads = torch.autograd.grad(loss / DP, list(head.parameters()))
                        for p, g in zip(head.parameters(), grads):
                            p.grad += g
            for idx, module in modules.items():
                ref_params = dict(reference[idx].named_parameters())
                for name, p in module.named_parameters():
                    msg = f"{kind} {schedule} {grad_mode} {loss_kind} step {it}: stage {idx} {name}"
                    self.assertIsNotNone(p.grad, msg=msg)
                    grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                    self.assertEqual(grad, ref_params[name].grad, atol=1e-10, rtol=1e-8, msg=msg)
            optim.step()
            optim.zero_grad()
            with torch.no_grad():
                for p_ref in reference.parameters():
                    p_ref.sub_(p_ref.grad * LR)
                    p_ref.grad = None
            # An eval() after the optimizer step, with no training step in
            # between, computes with the updated parameters
            losses: list[torch.Tensor] = []
            with torch.no_grad():
                call(sched.eval, evaluation, losses)
            if last in modules:
                with torch.no_grad():
                    expected = ref_losses(evaluation)
                self.assertEqual(
                    torch.stack(losses), torch.stack(expected), atol=1e-10, rtol=1e-8,
                    msg=f"{kind} {schedule} {grad_mode} {loss_kind} eval after optimizer step {it}",
                )


instantiate_parametrized_tests(TestPipelineContainerEvalAfterStep)


if __name__ == "__main__":
    run_tests()
