# Owner(s): ["oncall: distributed"]
"""
A training step treats the FSDP roots of a stage module that is a plain
container of ``fully_shard``'ed blocks as it treats an FSDP stage module:
no-sync from the step's entry (the microbatches' gradients accumulate
unreduced), one reduction per block at the gradient finalization, pending
gradients across ``finalize_gradients=False`` steps, and the caller's FSDP
policy back after every step. Zero-bubble schedules then find the gradients
unreduced in the weight backward and train such stages too.

pp 2 x FSDP 2 on gloo/CPU; reduce-scatters are counted per step, and the
gradients are compared with a single-process reference over several optimizer
steps.
"""

import copy
import os
import sys
from dataclasses import replace

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
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
from torch.distributed.pipelining.schedules import (
    _Action,
    _ComputationType,
    PipelineScheduleMulti,
)
from torch.distributed.tensor import DTensor
from torch.testing._internal.common_utils import (
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
)


sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from fsdp_lifecycle_testing import (  # noqa: E402
    CollectiveCounter,
    GlooMultiProcessTestCase,
)


DIM = 8
NUM_MICROBATCHES = 4
MICROBATCH_SIZE = 2
BATCH = NUM_MICROBATCHES * MICROBATCH_SIZE
LR = 0.1

class ForwardsThenBackwards(PipelineScheduleMulti):
    """A custom schedule of one stage on one rank, written as a
    ``pipeline_order`` that ``PipelineScheduleMulti`` runs itself."""

    def __init__(self, stages, n_microbatches, loss_fn, **kwargs):
        super().__init__(stages, n_microbatches, loss_fn=loss_fn, **kwargs)
        self.pipeline_order = {
            0: [_Action(0, _ComputationType.FORWARD, i) for i in range(n_microbatches)]
            + [
                _Action(0, _ComputationType.FULL_BACKWARD, i)
                for i in range(n_microbatches)
            ]
        }


# name: (schedule class, stage placement: one stage per rank, two in a loop,
# or two in a V)
SCHEDULES = {
    "gpipe": (ScheduleGPipe, "single"),
    "1f1b": (Schedule1F1B, "single"),
    "interleaved_1f1b": (ScheduleInterleaved1F1B, "loop"),
    "looped_bfs": (ScheduleLoopedBFS, "loop"),
    "interleaved_zb": (ScheduleInterleavedZeroBubble, "loop"),
    "zbv": (ScheduleZBVZeroBubble, "v"),
    "dualpipev": (ScheduleDualPipeV, "v"),
}
CUSTOM = {"custom": (ForwardsThenBackwards, "single")}


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
    @property
    def world_size(self) -> int:
        return 4

    def _meshes(self):
        """``(pp mesh, data-parallel mesh)``: FSDP over two ranks."""
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
        return mesh["pp"], mesh["dp"]

    def _build(self, schedule: str, share_block: bool = False):
        """This rank's container stages (blocks sharded over the data-parallel
        mesh) and their schedule, and the single-process reference. With
        ``share_block``, stage ``i + pp`` reuses stage ``i``'s first block
        (loop placement: both on one rank)."""
        schedule_cls, placement = {**SCHEDULES, **CUSTOM}[schedule]
        pp_mesh, dp_mesh = self._meshes()
        pp, pp_rank = pp_mesh.size(), pp_mesh.get_local_rank()
        indices = {
            "single": [pp_rank],
            "loop": [pp_rank, pp_rank + pp],
            "v": sorted([pp_rank, 2 * pp - 1 - pp_rank]),
        }[placement]
        num_stages = pp * len(indices)
        # Double precision: the pipeline and the reference sum the
        # microbatches' gradients in different orders
        torch.set_default_dtype(torch.float64)
        torch.manual_seed(0)
        self.reference = nn.ModuleList([ContainerStage() for _ in range(num_stages)])
        if share_block:
            for idx in range(pp):
                self.reference[idx + pp].blocks[0] = self.reference[idx].blocks[0]
        self.last = num_stages - 1
        self.modules: dict[int, ContainerStage] = {}
        self.params: dict[int, list[tuple[str, nn.Parameter]]] = {}
        stages = []
        # One copy of this rank's stage modules, so that they share what the
        # reference's share
        local = copy.deepcopy(nn.ModuleList([self.reference[idx] for idx in indices]))
        self.blocks = []
        for idx, module in zip(indices, local):
            for block in module.blocks:
                if not any(block is b for b in self.blocks):
                    fully_shard(block, mesh=dp_mesh)
                    self.blocks.append(block)
            self.assertNotIsInstance(module, FSDPModule)
            self.modules[idx] = module
            self.params[idx] = list(module.named_parameters())
            stages.append(
                PipelineStage(
                    module, idx, num_stages, torch.device("cpu"), group=pp_mesh.get_group()
                )
            )
        target = stages[0] if placement == "single" and schedule != "custom" else stages
        # scale_grads=False with a shared block: the schedule scales each
        # stage's gradients, so a parameter that two local stages share is
        # divided twice (on every torch)
        self.scale = not share_block
        kwargs = {} if self.scale else {"scale_grads": False}
        return schedule_cls(target, NUM_MICROBATCHES, loss_fn=F.mse_loss, **kwargs)

    def _data(self, seed: int):
        # The same batch on both data-parallel ranks: FSDP's mean over them
        # is the reference's gradient
        gen = torch.Generator().manual_seed(seed)
        return torch.randn(BATCH, DIM, generator=gen), torch.randn(BATCH, DIM, generator=gen)

    def _call(self, fn, data, **kwargs):
        x, y = data
        args = (x,) if 0 in self.modules else ()
        if self.last in self.modules:
            kwargs["target"] = y
        return fn(*args, **kwargs)

    def _reduce_scatters(self, fn, data, kind: str = "reduce_scatter", **kwargs) -> int:
        counter = CollectiveCounter()
        with counter.count():
            self._call(fn, data, **kwargs)
        return counter[kind]

    def _reference_grads(self, batches) -> None:
        """Accumulate the reference gradients of ``batches``: the mean over
        the microbatches of each microbatch's loss (their sum with
        ``scale_grads=False``)."""
        for x, y in batches:
            for xm, ym in zip(x.chunk(NUM_MICROBATCHES), y.chunk(NUM_MICROBATCHES)):
                h = xm
                for module in self.reference:
                    h = module(h)
                (F.mse_loss(h, ym) / (NUM_MICROBATCHES if self.scale else 1)).backward()

    def _assert_grads_match(self, msg: str) -> None:
        for idx, params in self.params.items():
            for (name, p), p_ref in zip(params, self.reference[idx].parameters(), strict=True):
                grad = p.grad
                if isinstance(grad, DTensor):
                    grad = grad.full_tensor()
                self.assertIsNotNone(grad, msg=f"{msg}: stage {idx} {name}")
                self.assertEqual(grad, p_ref.grad, atol=1e-10, rtol=1e-8,
                                 msg=f"{msg}: stage {idx} {name}")

    def _optimizer_step(self) -> None:
        with torch.no_grad():
            params = {id(p): p for ps in self.params.values() for _, p in ps}
            for p in params.values():
                p.sub_(p.grad * LR)
                p.grad = None
            for p_ref in self.reference.parameters():
                p_ref.sub_(p_ref.grad * LR)
                p_ref.grad = None


class TestPipelineContainerStageNoSync(_Base):
    @parametrize("schedule", list(SCHEDULES))
    def test_blocks_reduce_once_per_finalizing_step(self, schedule: str):
        """step, then step(finalize_gradients=False), eval() under no_grad
        (not on the V-shaped schedules, whose eval() fails on every torch) and
        step, each pair followed by an optimizer step, twice: a finalizing
        step reduce-scatters once per block (2.15.0: once per block and
        microbatch; zero-bubble schedules: no weight gradient for the later
        stages' blocks, which the series refused before), the others not at
        all, with gradients pending between them; the gradients equal the
        reference's, the plain projection's included (scaled once, at the
        finalization), and the caller's policy of every block is back after
        every call."""
        sched = self._build(schedule)
        caller = [block.get_fsdp_policy() for block in self.blocks]
        num_blocks = len(self.blocks)
        for it in range(2):
            a = self._data(4 * it)
            self.assertEqual(self._reduce_scatters(sched.step, a), num_blocks,
                             msg=f"{schedule} {it}: step")
            self.assertFalse(any(block.has_pending_gradients() for block in self.blocks))
            self.assertEqual([block.get_fsdp_policy() for block in self.blocks], caller)
            self._reference_grads([a])
            self._assert_grads_match(f"{schedule} {it}: step")
            self._optimizer_step()

            b, e, c = self._data(4 * it + 1), self._data(4 * it + 2), self._data(4 * it + 3)
            self.assertEqual(
                self._reduce_scatters(sched.step, b, finalize_gradients=False), 0,
                msg=f"{schedule} {it}: step(finalize_gradients=False)",
            )
            self.assertTrue(all(block.has_pending_gradients() for block in self.blocks))
            self.assertEqual([block.get_fsdp_policy() for block in self.blocks], caller)
            if SCHEDULES[schedule][1] != "v":
                with torch.no_grad():
                    self.assertEqual(self._reduce_scatters(sched.eval, e), 0)
            self.assertTrue(all(block.has_pending_gradients() for block in self.blocks))
            self.assertEqual(self._reduce_scatters(sched.step, c), num_blocks,
                             msg=f"{schedule} {it}: finalizing step")
            self.assertFalse(any(block.has_pending_gradients() for block in self.blocks))
            self.assertEqual([block.get_fsdp_policy() for block in self.blocks], caller)
            self._reference_grads([b, c])
            self._assert_grads_match(f"{schedule} {it}: accumulate, eval, step")
            self._optimizer_step()

    @parametrize("schedule", ["gpipe", "interleaved_1f1b", "zbv"])
    def test_finalizing_step_keeps_callers_no_sync(self, schedule: str):
        """FSDP2's accumulation idiom: with the caller's
        ``set_requires_gradient_sync(False)`` on every block, a finalizing
        step reduces nothing and scales nothing (the blocks keep their
        gradients pending, as on 2.15.0), and the caller's policy is back
        after it; the next step, after ``set_requires_gradient_sync(True)``,
        reduces each block once and the gradients are the sum of both steps'
        means (the series before this fix reduced and scaled at both steps:
        off by ~1), over two optimizer steps."""
        sched = self._build(schedule)
        for it in range(2):
            for block in self.blocks:
                block.set_requires_gradient_sync(False)
            caller = [block.get_fsdp_policy() for block in self.blocks]
            self.assertFalse(any(policy.requires_gradient_sync for policy in caller))
            a, b = self._data(2 * it), self._data(2 * it + 1)
            self.assertEqual(self._reduce_scatters(sched.step, a), 0,
                             msg=f"{schedule} {it}: no-sync step")
            self.assertTrue(all(block.has_pending_gradients() for block in self.blocks))
            self.assertEqual([block.get_fsdp_policy() for block in self.blocks], caller)
            for block in self.blocks:
                block.set_requires_gradient_sync(True)
            caller = [block.get_fsdp_policy() for block in self.blocks]
            self.assertEqual(self._reduce_scatters(sched.step, b), len(self.blocks),
                             msg=f"{schedule} {it}: syncing step")
            self.assertFalse(any(block.has_pending_gradients() for block in self.blocks))
            self.assertEqual([block.get_fsdp_policy() for block in self.blocks], caller)
            self._reference_grads([a, b])
            self._assert_grads_match(f"{schedule} {it}")
            self._optimizer_step()

    @parametrize("schedule", ["interleaved_1f1b", "looped_bfs"])
    def test_block_shared_by_two_stages_of_a_rank(self, schedule: str):
        """A block that two container stages of a rank share joins neither
        (it reduces per backward) and the others accumulate: step,
        step(finalize_gradients=False) and step raise nothing, the gradients
        equal the reference's and the caller's policy is back, over two
        optimizer steps."""
        sched = self._build(schedule, share_block=True)
        caller = [block.get_fsdp_policy() for block in self.blocks]
        for it in range(2):
            a, b, c = (self._data(3 * it + k) for k in range(3))
            self._call(sched.step, a)
            self._reference_grads([a])
            self._assert_grads_match(f"{schedule} {it}: step")
            self._optimizer_step()
            self._call(sched.step, b, finalize_gradients=False)
            self.assertEqual([block.get_fsdp_policy() for block in self.blocks], caller)
            self._call(sched.step, c)
            self.assertFalse(any(block.has_pending_gradients() for block in self.blocks))
            self.assertEqual([block.get_fsdp_policy() for block in self.blocks], caller)
            self._reference_grads([b, c])
            self._assert_grads_match(f"{schedule} {it}: accumulate")
            self._optimizer_step()


class TestPipelineContainerStageCustomSchedule(_Base):
    """FSDP over two ranks, each a pipeline of one container stage run by a
    custom ``PipelineScheduleMulti``."""

    @property
    def world_size(self) -> int:
        return 2

    def _meshes(self):
        mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("pp", "dp"))
        return mesh["pp"], mesh["dp"]

    def test_custom_schedule_finalizes_the_blocks(self):
        """PipelineScheduleMulti's own step loop finalizes the blocks after
        the stage's last backward: step, then step(finalize_gradients=False)
        and step, twice, reduce-scatter once per block per finalizing step
        with the reference gradients and nothing pending."""
        sched = self._build("custom")
        for it in range(2):
            a, b, c = (self._data(3 * it + k) for k in range(3))
            self.assertEqual(self._reduce_scatters(sched.step, a), len(self.blocks))
            self.assertFalse(any(block.has_pending_gradients() for block in self.blocks))
            self._reference_grads([a])
            self._assert_grads_match(f"custom {it}: step")
            self._optimizer_step()
            self.assertEqual(
                self._reduce_scatters(sched.step, b, finalize_gradients=False), 0
            )
            self.assertEqual(self._reduce_scatters(sched.step, c), len(self.blocks))
            self.assertFalse(any(block.has_pending_gradients() for block in self.blocks))
            self._reference_grads([b, c])
            self._assert_grads_match(f"custom {it}: accumulate")
            self._optimizer_step()


class TestPipelineContainerStageNoSyncHSDP(_Base):
    """pp 2 x replicate 2 x shard 1: each block is an HSDP module whose replica
    all-reduce moves data."""

    def _meshes(self):
        mesh = init_device_mesh(
            "cpu", (2, 2, 1), mesh_dim_names=("pp", "replicate", "shard")
        )
        self.replica_rank = mesh["replicate"].get_local_rank()
        self.replicate_group = mesh["replicate"].get_group()
        return mesh["pp"], mesh["replicate", "shard"]

    @parametrize("schedule", ["gpipe", "interleaved_1f1b"])
    def test_hsdp_all_reduces_once_per_finalizing_step(self, schedule: str):
        """With the caller's HSDP no-sync on every block
        (``requires_gradient_sync=False``, ``requires_all_reduce=False``),
        step(finalize_gradients=False), then step after the caller's
        ``set_requires_gradient_sync(True)``, on different data per
        replica: the finalizing step all-reduces once per block across the
        replicas (2.15.0: never), the gradients equal the reference's mean
        over both replicas' data, and the caller's policy is back after each
        step, over two optimizer steps."""
        sched = self._build(schedule)
        for block in self.blocks:
            block.set_fsdp_policy(
                replace(
                    block.get_fsdp_policy(),
                    requires_gradient_sync=False,
                    requires_all_reduce=False,
                ),
                recurse=False,
            )
        no_sync = [block.get_fsdp_policy() for block in self.blocks]
        for it in range(2):
            batches = []
            for finalize in (False, True):
                if finalize:
                    # The caller syncs the step that finalizes; see
                    # test_finalizing_step_keeps_callers_no_sync
                    for block in self.blocks:
                        block.set_requires_gradient_sync(True)
                caller = [block.get_fsdp_policy() for block in self.blocks]
                gen = torch.Generator().manual_seed(10 * it + finalize)
                x = torch.randn(2 * BATCH, DIM, generator=gen)
                y = torch.randn(2 * BATCH, DIM, generator=gen)
                halves = list(zip(x.chunk(2), y.chunk(2)))
                batches.extend(halves)
                all_reduces = self._reduce_scatters(
                    sched.step, halves[self.replica_rank], kind="all_reduce",
                    finalize_gradients=finalize,
                )
                if it or finalize:
                    # (The schedule's first step also all-reduces to set up
                    # the pipeline)
                    self.assertEqual(all_reduces, len(self.blocks) if finalize else 0,
                                     msg=f"{schedule} {it} finalize={finalize}")
                self.assertEqual([block.get_fsdp_policy() for block in self.blocks], caller)
            for block, policy in zip(self.blocks, no_sync):
                block.set_fsdp_policy(policy, recurse=False)
            self._reference_grads(batches)
            for p_ref in self.reference.parameters():
                p_ref.grad.div_(2)  # the mean over the two replicas
            # The plain projection is not data parallel: average it by hand
            for params in self.params.values():
                for name, p in params:
                    if name.startswith("proj."):
                        dist.all_reduce(p.grad, group=self.replicate_group)
                        p.grad.div_(2)
            self._assert_grads_match(f"{schedule} hsdp {it}")
            self._optimizer_step()


instantiate_parametrized_tests(TestPipelineContainerStageNoSync)
instantiate_parametrized_tests(TestPipelineContainerStageNoSyncHSDP)
instantiate_parametrized_tests(TestPipelineContainerStageCustomSchedule)


if __name__ == "__main__":
    run_tests()
