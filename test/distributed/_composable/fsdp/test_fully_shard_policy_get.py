# Owner(s): ["oncall: distributed"]
"""
Tests for ``FSDPModule.get_fsdp_policy`` (part of pytorch/pytorch#203177): a
module's policy reads what ``fully_shard`` and the per-field setters set, as
``fully_shard`` normalizes it, for modules with and without parameters and for
``replicate()`` modules, and reading changes nothing across training steps.
Applying policies is tested in ``test_fully_shard_policy_set.py``.
"""

import os
import sys

import numpy as np
import torch
import torch.nn as nn
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.fsdp import FSDPPolicy, fully_shard
from torch.testing._internal.common_utils import run_tests


sys.path.insert(
    0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
)
from fsdp_lifecycle_testing import fsdp_policies, GlooMultiProcessTestCase  # noqa: E402


DIM = 8


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(DIM, DIM)
        self.body = nn.Sequential(nn.Linear(DIM, DIM), nn.Linear(DIM, DIM))
        self.head = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(self.embed(x))))


def _train(model: nn.Module, rank: int, steps: int) -> None:
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        model(torch.randn(4, DIM, generator=gen)).sum().backward()
        optim.step()
        optim.zero_grad()


class TestFullyShardGetPolicy(GlooMultiProcessTestCase):
    @property
    def world_size(self) -> int:
        return 2

    def test_reads_fully_shard_arguments(self):
        """
        ``reshard_after_forward`` reads as ``fully_shard`` normalizes it (``1``
        as ``False``, the shard mesh size as ``True``, ``None`` for the
        automatic choice), before and after training steps.
        """
        for given, expected in (
            (None, None),
            (True, True),
            (False, False),
            (1, False),
            (2, True),
        ):
            torch.manual_seed(0)
            model = Model()
            for block in model.body:
                fully_shard(block, reshard_after_forward=given)
            fully_shard(model)
            want = {
                "": FSDPPolicy(),
                "body.0": FSDPPolicy(reshard_after_forward=expected),
                "body.1": FSDPPolicy(reshard_after_forward=expected),
            }
            self.assertEqual(fsdp_policies(model), want, f"given {given!r}")
            _train(model, self.rank, steps=3)
            self.assertEqual(fsdp_policies(model), want, f"given {given!r}, trained")

    def test_reads_the_setters(self):
        """
        The per-field setters' values read back as ``bool``, bool-like values
        (``numpy.bool_``, ``0``) included, on modules with and without
        parameters; ``set_requires_gradient_sync`` also sets
        ``requires_all_reduce``, as on 2.15.0.
        """
        torch.manual_seed(0)
        model = Model()
        for name in ("embed", "head"):
            fully_shard(getattr(model, name))
        for block in model.body:
            fully_shard(block)
        fully_shard(model)  # the root holds no parameters of its own
        self.assertEqual(model._get_fsdp_state()._fsdp_param_groups, [])
        names = ["", "embed", "body.0", "body.1", "head"]
        self.assertEqual(sorted(fsdp_policies(model)), sorted(names))
        model.set_requires_all_reduce(np.bool_(False))
        expected = FSDPPolicy(requires_all_reduce=False)
        self.assertEqual(set(fsdp_policies(model).values()), {expected})
        model.set_reshard_after_backward(0, recurse=True)
        expected = FSDPPolicy(requires_all_reduce=False, reshard_after_backward=False)
        self.assertEqual(set(fsdp_policies(model).values()), {expected})
        model.set_requires_gradient_sync(False)
        expected = FSDPPolicy(
            requires_gradient_sync=False,
            requires_all_reduce=False,
            reshard_after_backward=False,
        )
        self.assertEqual(set(fsdp_policies(model).values()), {expected})
        model.set_requires_gradient_sync(True)
        model.set_reshard_after_backward(True)
        model.set_reshard_after_forward(False)
        policies = fsdp_policies(model)
        self.assertEqual(
            set(policies.values()), {FSDPPolicy(reshard_after_forward=False)}
        )
        _train(model, self.rank, steps=3)
        self.assertEqual(fsdp_policies(model), policies)

    def test_replicate_reads_no_reshard_after_forward(self):
        """A ``replicate()`` module never reshards after forward and reads so."""
        torch.manual_seed(0)
        model = Model()
        for block in model.body:
            fully_shard(block)
        replicate(model.head)
        fully_shard(model)
        self.assertEqual(
            model.head.get_fsdp_policy(), FSDPPolicy(reshard_after_forward=False)
        )
        model.head.set_requires_all_reduce(False)
        _train(model, self.rank, steps=2)
        self.assertEqual(
            model.head.get_fsdp_policy(),
            FSDPPolicy(requires_all_reduce=False, reshard_after_forward=False),
        )
        self.assertEqual(model.body[0].get_fsdp_policy(), FSDPPolicy())


if __name__ == "__main__":
    run_tests()
