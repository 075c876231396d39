# Owner(s): ["oncall: distributed"]
"""
Tests for ``FSDPModule.set_fsdp_policy`` (part of pytorch/pytorch#203177):
re-applying a module's own policy changes nothing and runs no collective; a
no-sync policy applied for all but the last microbatch, then the saved
policies, accumulates the gradients of the full batch with one reduction per
step and leaves ``requires_all_reduce`` as the caller set it; invalid policies
raise before any module changes.
"""

import dataclasses
import os
import sys

import torch
import torch.nn as nn
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.fsdp import FSDPModule, FSDPPolicy, fully_shard
from torch.testing._internal.common_utils import run_tests


sys.path.insert(
    0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
)
from fsdp_lifecycle_testing import (  # noqa: E402
    CollectiveCounter,
    fsdp_policies,
    fsdp_states,
    GlooMultiProcessTestCase,
)


DIM = 8
NUM_MICROBATCHES = 3


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(DIM, DIM)
        self.body = nn.Sequential(nn.Linear(DIM, DIM), nn.Linear(DIM, DIM))
        self.head = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(self.embed(x))))


def _shard(model: Model, reshard_after_forward=None) -> Model:
    for block in model.body:
        fully_shard(block, reshard_after_forward=reshard_after_forward)
    fully_shard(model)
    return model


def _fsdp_modules(model: nn.Module) -> list[FSDPModule]:
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def _fields(model: nn.Module) -> list[tuple]:
    """Every field a policy is stored in, by identity where objects matter."""
    return [
        (
            state._auto_reshard_after_forward,
            state._explicit_reshard_after_forward,
            [
                (
                    group.reduce_grads,
                    group.all_reduce_grads,
                    group.reshard_after_backward,
                    id(group.post_forward_mesh_info),
                )
                for group in state._fsdp_param_groups
            ],
        )
        for state in fsdp_states(model)
    ]


class TestFullyShardSetPolicy(GlooMultiProcessTestCase):
    @property
    def world_size(self) -> int:
        return 2

    def _microbatches(self, step: int) -> tuple[list[torch.Tensor], torch.Tensor]:
        """This rank's microbatches and every rank's, concatenated."""
        gen = torch.Generator().manual_seed(step)
        every = [
            [torch.randn(4, DIM, generator=gen) for _ in range(NUM_MICROBATCHES)]
            for _ in range(self.world_size)
        ]
        return every[self.rank], torch.cat([torch.cat(mbs) for mbs in every])

    def test_round_trip_changes_nothing(self):
        """
        ``m.set_fsdp_policy(m.get_fsdp_policy(), recurse=False)`` on every
        module leaves every stored field as it was and runs no collective,
        before lazy init and between steps.
        """
        for given in (None, True, False):
            torch.manual_seed(0)
            model = _shard(Model(), reshard_after_forward=given)
            model.set_reshard_after_backward(0)  # a setter's bool-like value
            optim = torch.optim.SGD(model.parameters(), lr=0.1)
            for step in range(3):
                before, policies = _fields(model), fsdp_policies(model)
                counter = CollectiveCounter()
                with counter.count():
                    for module in _fsdp_modules(model):
                        module.set_fsdp_policy(module.get_fsdp_policy(), recurse=False)
                self.assertEqual(sum(counter.counts.values()), 0)
                self.assertEqual(_fields(model), before, f"{given!r}, step {step}")
                self.assertEqual(fsdp_policies(model), policies)
                local, _ = self._microbatches(step)
                model(local[0]).sum().backward()
                optim.step()
                optim.zero_grad()

    def test_no_sync_accumulation_and_restore(self):
        """
        Gradient accumulation: the saved policies with
        ``requires_gradient_sync=False`` for all but the last microbatch, then
        the saved policies again. Over several steps the gradients equal the
        full batch's on one process, only the last microbatch reduce-scatters,
        and every module reads its saved policy afterwards, with
        ``requires_all_reduce=False`` kept (``set_requires_gradient_sync(True)``
        would turn it back on).
        """
        torch.manual_seed(0)
        model = Model()
        ref = Model()
        ref.load_state_dict(model.state_dict())
        _shard(model)
        model.set_requires_all_reduce(False)
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        ref_optim = torch.optim.SGD(ref.parameters(), lr=0.1)
        modules = _fsdp_modules(model)
        for step in range(3):
            local, every = self._microbatches(step)
            saved = [(m, m.get_fsdp_policy()) for m in modules]
            counter = CollectiveCounter()
            for i, x in enumerate(local):
                last = i == len(local) - 1
                for module, policy in saved:
                    module.set_fsdp_policy(
                        dataclasses.replace(policy, requires_gradient_sync=last),
                        recurse=False,
                    )
                with counter.count():
                    model(x).sum().backward()
                if i == len(local) - 2:
                    self.assertEqual(counter["reduce_scatter"], 0, f"step {step}")
            for module, policy in saved:
                module.set_fsdp_policy(policy, recurse=False)
            self.assertEqual(
                [m.get_fsdp_policy() for m in modules], [p for _, p in saved]
            )
            self.assertFalse(any(p.requires_all_reduce for _, p in saved))
            # The last microbatch: one reduce-scatter per FSDP state (each
            # holds parameters)
            self.assertEqual(counter["reduce_scatter"], len(modules))
            (ref(every).sum() / self.world_size).backward()
            for (name, param), ref_param in zip(
                model.named_parameters(), ref.parameters()
            ):
                self.assertEqual(param.grad.full_tensor(), ref_param.grad, msg=name)
            for o in (optim, ref_optim):
                o.step()
                o.zero_grad()

    def test_invalid_policies_change_nothing(self):
        """
        ``recurse`` is required, a non-policy raises ``TypeError``, an ``int``
        that does not divide the mesh or resharding a ``replicate()`` module
        raises ``ValueError``; none of them changes any module.
        """
        torch.manual_seed(0)
        model = Model()
        for block in model.body:
            fully_shard(block)
        replicate(model.head)
        fully_shard(model)
        before, policies = _fields(model), fsdp_policies(model)
        with self.assertRaisesRegex(TypeError, "recurse"):
            model.set_fsdp_policy(FSDPPolicy())  # type: ignore[call-arg]
        with self.assertRaisesRegex(TypeError, "FSDPPolicy"):
            model.set_fsdp_policy("no-sync", recurse=True)  # type: ignore[arg-type]
        with self.assertRaisesRegex(ValueError, "reshard_after_forward"):
            model.set_fsdp_policy(FSDPPolicy(reshard_after_forward=3), recurse=True)
        for value in (True, 2):
            # the body is changed before the head in module order: all or nothing
            with self.assertRaisesRegex(ValueError, "replicates"):
                model.set_fsdp_policy(
                    FSDPPolicy(
                        requires_gradient_sync=False, reshard_after_forward=value
                    ),
                    recurse=True,
                )
        self.assertEqual(_fields(model), before)
        self.assertEqual(fsdp_policies(model), policies)


if __name__ == "__main__":
    run_tests()
