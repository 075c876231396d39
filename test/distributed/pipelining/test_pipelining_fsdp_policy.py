# Owner(s): ["oncall: distributed"]
"""
A pipeline step of FSDP stages and the caller's FSDP policy: metadata
inference leaves the caller's unsharded groups resident, the caller's policy
is in force between any two steps, a finalizing HSDP step all-reduces and
restores the caller's flags, and replicate() stages train.

Gloo on CPU; gradients are compared with a single-process reference over
several optimizer steps. The model, schedules and helpers are those of
test_pipelining_fsdp_step.py.
"""

import os
import sys
from dataclasses import replace

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.testing._internal.common_utils import (
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
)


sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from fsdp_lifecycle_testing import CollectiveCounter  # noqa: E402
from test_pipelining_fsdp_step import (  # noqa: E402
    BATCH,
    DIM,
    _Base,
)


class TestPipelineStepWorld2(_Base):
    @property
    def world_size(self) -> int:
        return 2

    @parametrize("schedule", ["gpipe", "1f1b", "interleaved_1f1b", "looped_bfs"])
    @parametrize("aux_loss", [False, True])
    def test_replicate_stages_train(self, schedule: str, aux_loss: bool):
        """Finding 1: replicate() stage modules train as on 2.15.0 (revision 2
        raised on the first step), with a plain loss and with a loss that
        runs backward itself."""
        sched = self._build(schedule, "replicate", aux_loss=aux_loss)
        for it in range(2):
            x, y = self._data(it)
            self._run_step(sched, x, y)
            self._reference_grads([(x, y)])
            self._assert_grads_match(f"{schedule} aux={aux_loss} step {it}")
            self._optimizer_step()

    @parametrize(
        "case", ["rab_before", "rab_between", "rgs_before", "rgs_between", "raf_in_loss"]
    )
    def test_callers_policy_between_steps(self, case: str):
        """Findings 2, 8 and 9: the caller's policy is in force between any two
        steps whenever the call is made; a finalizing step reduces and reshards
        every group (as 2.15.0) whatever flags other than
        ``requires_gradient_sync`` the caller left; a change made by the loss
        during the step persists. (What a finalizing step does under the
        caller's ``requires_gradient_sync=False`` is
        test_pipelining_fsdp_caller_no_sync.py's: only the policy is checked
        here for the ``rgs`` cases.)"""
        sched = self._build("gpipe", "fsdp")
        stage_mod = self.modules[self.rank]
        fsdp_modules = [stage_mod, *stage_mod.blocks]
        loss_fn = sched._loss_fn
        field, value = {
            "rab": ("reshard_after_backward", False),
            "rgs": ("requires_gradient_sync", False),
            "raf": ("reshard_after_forward", False),
        }[case[:3]]

        def set_field(module):
            module.set_fsdp_policy(
                replace(module.get_fsdp_policy(), **{field: value}), recurse=False
            )

        in_finalizing_step = [False]
        if case == "raf_in_loss":
            # The loss changes a field the step does not own, during the
            # finalizing step only
            def loss_with_policy_change(out, target):
                if in_finalizing_step[0]:
                    set_field(self.modules[self.last].blocks[0])
                return loss_fn(out, target)
            sched._loss_fn = loss_with_policy_change
        for it in range(2):
            a, b = self._data(2 * it), self._data(2 * it + 1)
            if case.endswith("before"):
                for m in fsdp_modules:
                    set_field(m)
            expected = {id(m): m.get_fsdp_policy() for m in fsdp_modules}
            self._run_step(sched, *a, finalize_gradients=False)
            if case != "raf_in_loss":
                for m in fsdp_modules:
                    self.assertEqual(m.get_fsdp_policy(), expected[id(m)], msg=case)
            if case.endswith("between"):
                for m in fsdp_modules:
                    set_field(m)
                expected = {id(m): m.get_fsdp_policy() for m in fsdp_modules}
            in_finalizing_step[0] = True
            self._run_step(sched, *b)
            in_finalizing_step[0] = False
            if field != "requires_gradient_sync":
                self.assertFalse(stage_mod.has_pending_gradients(), msg=case)
                # Every group was resharded: the registered parameters are
                # sharded
                for m in fsdp_modules:
                    for p in m.parameters(recurse=False):
                        self.assertIsInstance(p, DTensor, msg=case)
            if case == "raf_in_loss":
                if self.last in self.modules:
                    policy = self.modules[self.last].blocks[0].get_fsdp_policy()
                    self.assertEqual(policy.reshard_after_forward, False, msg=case)
            else:
                for m in fsdp_modules:
                    self.assertEqual(m.get_fsdp_policy(), expected[id(m)], msg=case)
                    self.assertEqual(getattr(m.get_fsdp_policy(), field), value, msg=case)
            if field == "requires_gradient_sync":
                continue
            self._reference_grads([a, b])
            self._assert_grads_match(f"{case} step {it}")
            self._optimizer_step()


class TestPipelineStepHSDP(_Base):
    """pp 2 x replicate 2 x shard 1: HSDP whose replica all-reduce moves data."""

    @property
    def world_size(self) -> int:
        return 4

    def _meshes(self, dp: str):
        mesh = init_device_mesh(
            "cpu", (2, 2, 1), mesh_dim_names=("pp", "replicate", "shard")
        )
        self.replica_rank = mesh["replicate"].get_local_rank()
        return 2, mesh["pp"].get_local_rank(), mesh["pp"].get_group(), mesh[
            "replicate", "shard"
        ]

    @parametrize("schedule", ["gpipe", "interleaved_1f1b"])
    def test_hsdp_finalizing_step_all_reduces_and_restores(self, schedule: str):
        """Findings 2 and 9 under HSDP: with the caller's
        requires_all_reduce=False left over, a
        finalizing step still reduces across replicas as 2.15.0 did (the
        gradients equal the reference over both replicas' data), the caller's
        policy is back after every step, and accumulation works."""
        sched = self._build(schedule, "fsdp")
        fsdp_modules = [m for module in self.modules.values() for m in module.modules()
                        if isinstance(m, FSDPModule)]
        for m in fsdp_modules:
            m.set_fsdp_policy(
                replace(m.get_fsdp_policy(), requires_all_reduce=False),
                recurse=False,
            )
        caller = [m.get_fsdp_policy() for m in fsdp_modules]
        for it in range(2):
            batches = []
            for finalize in (False, True):
                gen = torch.Generator().manual_seed(10 * it + finalize)
                x = torch.randn(2 * BATCH, DIM, generator=gen)
                y = torch.randn(2 * BATCH, DIM, generator=gen)
                halves = list(zip(x.chunk(2), y.chunk(2)))
                batches.extend(halves)
                self._run_step(sched, *halves[self.replica_rank], finalize_gradients=finalize)
                self.assertEqual([m.get_fsdp_policy() for m in fsdp_modules], caller)
            self._reference_grads(batches)
            for p_ref in self.reference.parameters():
                if p_ref.grad is not None:
                    p_ref.grad.div_(2)  # mean over the two replicas
            self._assert_grads_match(f"{schedule} hsdp step {it}")
            self._optimizer_step()


class TestPipelineStepFSDP2(_Base):
    """pp 2 x FSDP 2: parameters are all-gathered across two ranks."""

    @property
    def world_size(self) -> int:
        return 4

    def _meshes(self, dp: str):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
        return 2, mesh["pp"].get_local_rank(), mesh["pp"].get_group(), mesh["dp"]

    @parametrize("schedule", ["gpipe", "interleaved_1f1b"])
    def test_metadata_inference_keeps_user_unshard(self, schedule: str):
        """Finding 8: metadata inference leaves the parameters that the user
        unsharded before the first step as they were: beyond what its probe
        gathers, the steps all-gather exactly as with static metadata (no
        inference), and train with the reference gradients. (2.15.0: step 0
        gathers 0 or 2 more on gpipe, 2 or 4 more on interleaved_1f1b, the
        later steps as many; revision 2: 6 to 16 more in step 0.)"""
        counts = {}
        for static in (False, True):
            sched = self._build(schedule, "fsdp", static_metadata=static)
            fsdp_modules = [
                m
                for module in self.modules.values()
                for m in module.modules()
                if isinstance(m, FSDPModule)
            ]
            for m in fsdp_modules:
                m.unshard()
            counter = CollectiveCounter()
            counts[static] = []
            for it in range(2):
                x, y = self._data(it)
                counter.reset()
                with counter.count():
                    self._run_step(sched, x, y)
                counts[static].append(counter["all_gather"])
                self._reference_grads([(x, y)])
                self._assert_grads_match(f"{schedule} static={static} step {it}")
                self._optimizer_step()
        # The probe itself may gather each FSDP group of this rank once more
        # in step 0 (its forward and backward reshard as a step does); after
        # it, every step all-gathers as with static metadata. Each FSDP module
        # here is one group (the root's own parameters are ``aux``'s)
        num_groups = len(fsdp_modules)
        msg = f"{schedule} rank {self.rank}: {counts}"
        self.assertLessEqual(counts[False][0] - counts[True][0], num_groups, msg=msg)
        self.assertEqual(counts[False][1:], counts[True][1:], msg=msg)


instantiate_parametrized_tests(TestPipelineStepWorld2)
instantiate_parametrized_tests(TestPipelineStepHSDP)
instantiate_parametrized_tests(TestPipelineStepFSDP2)


if __name__ == "__main__":
    run_tests()
