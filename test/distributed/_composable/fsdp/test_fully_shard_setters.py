# Owner(s): ["oncall: distributed"]
"""
The per-field setter ``FSDPModule.set_reshard_after_forward`` checks every
module it would change before changing any: on a tree with a ``replicate()``d
module it raises ``AssertionError`` (replicate never reshards after forward)
and leaves every module as it was. On 2.15.0 the same call changes the modules
it visits before the replicated one (the root's automatic choice, the blocks'
post-forward mesh) and then raises, so a training loop that catches the error
continues with a half-applied setting.

Only 2.15.0's APIs are used, so the test runs unchanged on 2.15.0, where
``test_raising_call_changes_nothing`` fails.
"""

import os
import sys

import torch
import torch.nn as nn
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.testing._internal.common_utils import run_tests


sys.path.insert(
    0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
)
from fsdp_lifecycle_testing import fsdp_states, GlooMultiProcessTestCase  # noqa: E402


DIM = 8


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(DIM, DIM)
        self.body = nn.Sequential(nn.Linear(DIM, DIM), nn.Linear(DIM, DIM))
        self.head = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(self.embed(x))))


def _settings(model: nn.Module) -> list[tuple]:
    """What ``set_reshard_after_forward`` writes, per FSDP state and group."""
    return [
        (
            state._auto_reshard_after_forward,
            [group.post_forward_mesh_info for group in state._fsdp_param_groups],
        )
        for state in fsdp_states(model)
    ]


class TestFullyShardSetReshardAfterForward(GlooMultiProcessTestCase):
    @property
    def world_size(self) -> int:
        return 2

    def test_raising_call_changes_nothing(self):
        """
        ``set_reshard_after_forward`` on a tree of ``fully_shard``ed blocks and
        a ``replicate()``d head raises ``AssertionError`` and changes no
        module, before and after lazy initialization; training steps between
        the failed calls give the same gradients as a tree on which they were
        never made.
        """
        models = []
        for _ in range(2):
            torch.manual_seed(0)
            model = Model()
            for block in model.body:
                fully_shard(block, reshard_after_forward=False)
            replicate(model.head)
            fully_shard(model)
            models.append(model)
        model, ref = models
        optims = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
        gen = torch.Generator().manual_seed(self.rank)
        for step in range(3):
            before = _settings(model)
            for value in (True, False):
                with self.assertRaises(AssertionError):
                    model.set_reshard_after_forward(value)
                self.assertEqual(_settings(model), before, f"step {step}")
            self.assertEqual(_settings(model), _settings(ref))
            x = torch.randn(4, DIM, generator=gen)
            for m in models:
                m(x).sum().backward()
            self.assertIsInstance(model, FSDPModule)
            for param, ref_param in zip(model.parameters(), ref.parameters()):
                self.assertEqual(param.grad, ref_param.grad)
            for optim in optims:
                optim.step()
                optim.zero_grad()


if __name__ == "__main__":
    run_tests()
