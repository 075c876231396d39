# Owner(s): ["oncall: distributed"]
"""
Pipeline stages whose module is a plain container of ``fully_shard``'ed
blocks (``fully_shard`` per block, the stage module itself left unwrapped):
each block is then its own FSDP root. The schedule treats such a stage as a
plain stage (each block reduces its gradients at the end of its own
backward), and the pipelining fixes for FSDP stages (metadata inference
probe and its FSDP reset, evaluation steps, failed-step cleanup) handle the
blocks too.

Gloo on CPU; gradients are compared with a single-process reference over
several optimizer steps.
"""

import copy
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
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
MICROBATCH_SIZE = 2
BATCH = NUM_MICROBATCHES * MICROBATCH_SIZE
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


class ContainerStage(nn.Module):
    """A plain projection and two blocks; the tests shard each block and
    leave the stage module (and the projection) unwrapped."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(DIM, DIM)
        self.blocks = nn.ModuleList([Block(), Block()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        for block in self.blocks:
            h = block(h)
        return h


class _Base(GlooMultiProcessTestCase):
    def _build(self, schedule: str):
        """The stages of this rank and their schedule (``scale_grads=False``:
        a container stage is a plain stage for the schedule, whose gradients
        accumulate across ``finalize_gradients=False`` steps only unscaled),
        and the single-process reference of the whole pipeline."""
        schedule_cls, per_rank = SCHEDULES[schedule]
        pp_size = self.world_size
        num_stages = pp_size * per_rank
        mesh = init_device_mesh("cpu", (pp_size, 1), mesh_dim_names=("pp", "dp"))["dp"]
        # Double precision: the pipeline and the reference sum the
        # microbatches' gradients in different orders
        torch.set_default_dtype(torch.float64)
        torch.manual_seed(0)
        self.reference = nn.ModuleList([ContainerStage() for _ in range(num_stages)])
        self.last = num_stages - 1
        self.modules: dict[int, ContainerStage] = {}
        self.params: dict[int, list[tuple[str, nn.Parameter]]] = {}
        stages = []
        for idx in (self.rank + i * pp_size for i in range(per_rank)):
            module = copy.deepcopy(self.reference[idx])
            for block in module.blocks:
                fully_shard(block, mesh=mesh)
            self.assertNotIsInstance(module, FSDPModule)
            self.modules[idx] = module
            # The sharded parameters, as an optimizer holds them: a block that
            # is its own FSDP root registers its unsharded parameters after an
            # eval() forward until the next step reshards it
            self.params[idx] = list(module.named_parameters())
            stages.append(PipelineStage(module, idx, num_stages, torch.device("cpu")))
        self.loss_hook = None
        target = stages[0] if per_rank == 1 else stages
        return schedule_cls(target, NUM_MICROBATCHES, loss_fn=self._loss, scale_grads=False)

    def _loss(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if self.loss_hook is not None:
            self.loss_hook()
        return F.mse_loss(out, target)

    def _data(self, seed: int):
        gen = torch.Generator().manual_seed(seed)
        return torch.randn(BATCH, DIM, generator=gen), torch.randn(BATCH, DIM, generator=gen)

    def _call(self, fn, data, **kwargs):
        x, y = data
        args = (x,) if 0 in self.modules else ()
        if self.last in self.modules:
            kwargs["target"] = y
        return fn(*args, **kwargs)

    def _eval(self, sched, data) -> None:
        with torch.no_grad():
            self._call(sched.eval, data)

    def _reference_grads(self, batches) -> None:
        """Accumulate the reference gradients of ``batches``: the sum over
        the microbatches of each microbatch's mean loss (``scale_grads=False``)."""
        for x, y in batches:
            for xm, ym in zip(x.chunk(NUM_MICROBATCHES), y.chunk(NUM_MICROBATCHES)):
                h = xm
                for module in self.reference:
                    h = module(h)
                F.mse_loss(h, ym).backward()

    def _assert_grads_match(self, msg: str) -> None:
        for idx, params in self.params.items():
            ref = self.reference[idx]
            for (name, p), p_ref in zip(params, ref.parameters(), strict=True):
                grad = p.grad
                if isinstance(grad, DTensor):
                    grad = grad.full_tensor()
                if p_ref.grad is None:
                    self.assertIsNone(grad, msg=f"{msg}: stage {idx} {name}")
                    continue
                self.assertIsNotNone(grad, msg=f"{msg}: stage {idx} {name}")
                self.assertEqual(grad, p_ref.grad, atol=1e-10, rtol=1e-8,
                                 msg=f"{msg}: stage {idx} {name}")

    def _policies(self) -> list:
        return [
            block.get_fsdp_policy()
            for module in self.modules.values()
            for block in module.blocks
        ]

    def _assert_nothing_pending(self, msg: str) -> None:
        for idx, module in self.modules.items():
            for i, block in enumerate(module.blocks):
                self.assertFalse(block.has_pending_gradients(),
                                 msg=f"{msg}: stage {idx} block {i}")

    def _optimizer_step(self) -> None:
        with torch.no_grad():
            for params in self.params.values():
                for _, p in params:
                    if p.grad is not None:
                        p.sub_(p.grad * LR)
                    p.grad = None
            for p_ref in self.reference.parameters():
                if p_ref.grad is not None:
                    p_ref.sub_(p_ref.grad * LR)
                p_ref.grad = None


class TestPipelineContainerStagesWorld2(_Base):
    @property
    def world_size(self) -> int:
        return 2

    @parametrize("schedule", list(SCHEDULES))
    def test_train_eval_accumulate_sequence(self, schedule: str):
        """step, step(finalize_gradients=False) + step, eval + step,
        step(finalize_gradients=False) + eval + step, and step + eval, each
        followed by an optimizer step, twice: the gradients equal the
        single-process reference's after each, the caller's FSDP policy of
        every block is unchanged, and nothing is pending."""
        sched = self._build(schedule)
        policies = self._policies()
        seed = 0

        def data():
            nonlocal seed
            seed += 1
            return self._data(seed)

        for it in range(2):
            a = data()
            self._call(sched.step, a)
            self._reference_grads([a])
            self._assert_grads_match(f"{schedule} {it}: step")
            self._optimizer_step()

            b, c = data(), data()
            self._call(sched.step, b, finalize_gradients=False)
            self.assertEqual(self._policies(), policies)
            self._call(sched.step, c)
            self._reference_grads([b, c])
            self._assert_grads_match(f"{schedule} {it}: accumulate")
            self._optimizer_step()

            e, d = data(), data()
            self._eval(sched, e)
            self._call(sched.step, d)
            self._reference_grads([d])
            self._assert_grads_match(f"{schedule} {it}: eval, step")
            self._optimizer_step()

            f, g, h = data(), data(), data()
            self._call(sched.step, f, finalize_gradients=False)
            self._eval(sched, g)
            self._call(sched.step, h)
            self._reference_grads([f, h])
            self._assert_grads_match(f"{schedule} {it}: accumulate, eval, step")
            self._optimizer_step()

            i, j = data(), data()
            self._call(sched.step, i)
            self._eval(sched, j)
            self._reference_grads([i])
            self._assert_grads_match(f"{schedule} {it}: step, eval")
            self._assert_nothing_pending(f"{schedule} {it}")
            self.assertEqual(self._policies(), policies)
            self._optimizer_step()


class TestPipelineContainerStagesWorld1(_Base):
    """All stages on one rank: a step that raises on every rank can be
    retried (single-stage schedules: with two stages on one rank, the failed
    step keeps the local receive buffer, and the retry raises
    PipeliningMetadataError whatever the stage module)."""

    @property
    def world_size(self) -> int:
        return 1

    @parametrize("schedule", ["gpipe", "1f1b"])
    @parametrize("where", ["forward", "loss"])
    def test_failed_step_retry_matches_reference(self, schedule: str, where: str):
        """step, a step that raises in a block's forward (after some
        microbatches ran) or in the loss, zero_grad() and its retry, eval,
        step: the gradients equal the reference's, nothing is pending after
        the failure, and the caller's policy is kept."""
        sched = self._build(schedule)
        policies = self._policies()
        calls = {"n": 0}

        def fail_third(*args):
            calls["n"] += 1
            if calls["n"] == 3:
                raise RuntimeError("injected failure")

        for it in range(2):
            a = self._data(4 * it)
            self._call(sched.step, a)
            self._reference_grads([a])
            self._assert_grads_match(f"{schedule} {where} {it}: step")
            self._optimizer_step()

            b = self._data(4 * it + 1)
            calls["n"] = 0
            if where == "forward":
                handle = self.modules[self.last].blocks[1].register_forward_pre_hook(fail_third)
            else:
                self.loss_hook = fail_third
            with self.assertRaises(RuntimeError) as raised:
                self._call(sched.step, b)
            # A stage reraises a forward's exception with the stage's details
            error = raised.exception
            self.assertIn("injected failure", f"{error} {error.__cause__}")
            if where == "forward":
                handle.remove()
            self.loss_hook = None
            self._assert_nothing_pending(f"{schedule} {where} {it}: failed step")
            self.assertEqual(self._policies(), policies)
            for params in self.params.values():  # zero_grad()
                for _, p in params:
                    p.grad = None
            self._call(sched.step, b)
            self._reference_grads([b])
            self._assert_grads_match(f"{schedule} {where} {it}: retry")
            self._optimizer_step()

            e, c = self._data(4 * it + 2), self._data(4 * it + 3)
            self._eval(sched, e)
            self._call(sched.step, c)
            self._reference_grads([c])
            self._assert_grads_match(f"{schedule} {where} {it}: eval, step")
            self._optimizer_step()


instantiate_parametrized_tests(TestPipelineContainerStagesWorld2)
instantiate_parametrized_tests(TestPipelineContainerStagesWorld1)


if __name__ == "__main__":
    run_tests()
