# Owner(s): ["oncall: distributed"]
"""
Tests for ``FSDPModule.is_fsdp_root`` before and after lazy initialization,
and for ``reset_iter_state`` on the root and on non-root modules.

Every multi-process test runs gloo on CPU through ``GlooMultiProcessTestCase``
(``FSDPTest`` skips every test on a CPU-only machine in torch 2.15.0).
"""

import os
import sys

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.testing._internal.common_utils import run_tests


sys.path.insert(
    0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
)
from fsdp_lifecycle_testing import GlooMultiProcessTestCase  # noqa: E402
from test_fully_shard_pending_gradients import (  # noqa: E402
    DIM,
    Model,
)


class TestFullyShardIsFSDPRoot(GlooMultiProcessTestCase):
    def test_is_fsdp_root(self):
        """
        ``is_fsdp_root()`` is ``False`` on every module before lazy init, then
        ``True`` exactly on the module whose forward ran it, for
        ``fully_shard`` and ``replicate()`` trees; ``reset_iter_state()``
        raises ``RuntimeError`` exactly where it is ``False`` after lazy init.
        """
        from torch.distributed._composable.replicate_with_fsdp import replicate

        mesh = init_device_mesh("cpu", (self.world_size,))
        for apply in (
            lambda m: fully_shard(m, mesh=mesh),
            lambda m: replicate(m, mesh=mesh),
        ):
            torch.manual_seed(0)
            model = Model()
            apply(model.lin0)
            apply(model.lin1)
            apply(model)
            modules = [model, model.lin0, model.lin1]
            self.assertEqual([m.is_fsdp_root() for m in modules], [False] * 3)
            for module in modules:
                module.reset_iter_state()  # no-op before lazy init
            model(torch.randn(2, DIM)).sum().backward()
            self.assertEqual([m.is_fsdp_root() for m in modules], [True, False, False])
            model.reset_iter_state()
            for module in modules[1:]:
                with self.assertRaisesRegex(RuntimeError, "root FSDP module"):
                    module.reset_iter_state()


if __name__ == "__main__":
    run_tests()
