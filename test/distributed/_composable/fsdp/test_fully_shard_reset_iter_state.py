# Owner(s): ["oncall: distributed"]
"""
Tests for ``FSDPModule.reset_iter_state`` before FSDP's first forward
completed: before lazy initialization, and after a root forward whose lazy
initialization raised. 2.15.0 raises ``AttributeError`` from the
communication context in both cases.

Every multi-process test runs gloo on CPU through ``GlooMultiProcessTestCase``
(``FSDPTest`` skips every test on a CPU-only machine in torch 2.15.0).
"""

import copy
import os
import sys

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.testing._internal.common_utils import run_tests


sys.path.insert(
    0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
)
from fsdp_lifecycle_testing import GlooMultiProcessTestCase  # noqa: E402


DIM = 8


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin0 = nn.Linear(DIM, DIM)
        self.lin1 = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin1(torch.tanh(self.lin0(x)))


class TestFullyShardResetBeforeFirstForward(GlooMultiProcessTestCase):
    def _build(self) -> tuple[Model, Model]:
        torch.manual_seed(0)
        ref_model = Model()
        model = copy.deepcopy(ref_model)
        mesh = init_device_mesh("cpu", (self.world_size,))
        fully_shard(model.lin0, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, ref_model

    def _check_training(self, model: Model, ref_model: Model) -> None:
        """Two SGD steps match the single-process reference."""
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        ref_optim = torch.optim.SGD(ref_model.parameters(), lr=0.1)
        for step in range(2):
            x = torch.randn(
                2 * self.world_size, DIM, generator=torch.Generator().manual_seed(step)
            )
            model(x.chunk(self.world_size)[self.rank]).sum().backward()
            ref_model(x).sum().div(self.world_size).backward()
            for name, param in model.named_parameters():
                ref_grad = dict(ref_model.named_parameters())[name].grad
                self.assertEqual(param.grad.full_tensor(), ref_grad, msg=name)
            for opt in (optim, ref_optim):
                opt.step()
                opt.zero_grad()

    def test_reset_iter_state_before_first_forward(self):
        """
        ``reset_iter_state`` before the root's first forward (e.g. recovering
        from a failure before FSDP ran) is a no-op (2.15.0 raised
        ``AttributeError``); training afterwards matches a reference.
        """
        model, ref_model = self._build()
        model.reset_iter_state()
        self.assertFalse(model.has_pending_gradients())
        self._check_training(model, ref_model)

    def test_reset_iter_state_after_failed_lazy_init(self):
        """
        A root forward whose lazy initialization raises (manual finalization
        enabled on a submodule) leaves the root in forward; ``reset_iter_state``
        is then a no-op that returns it to idle, so after fixing the cause the
        next forward initializes and trains like a reference. Revision 2 left
        the root in forward, so the retry raised ``AttributeError``.
        """
        model, ref_model = self._build()
        model.lin0.set_manual_backward_finalization(True)
        with self.assertRaisesRegex(RuntimeError, "must be called on the root"):
            model(torch.randn(2, DIM))
        model.reset_iter_state()
        model.lin0.set_manual_backward_finalization(False)
        self._check_training(model, ref_model)

    def test_reset_iter_state_after_lazy_init_marked_the_root(self):
        """
        A root forward after a submodule's forward raises in lazy
        initialization after marking the root (``_is_root`` is set before the
        tree is validated): ``reset_iter_state`` on it is a no-op instead of
        2.15.0's ``AttributeError``.
        """
        model, _ = self._build()
        model.lin0(torch.randn(2, DIM))
        with self.assertRaisesRegex(RuntimeError, "already been lazily initialized"):
            model(torch.randn(2, DIM))
        model.reset_iter_state()


if __name__ == "__main__":
    run_tests()
