# Owner(s): ["oncall: distributed"]
"""
Tests for the FSDP2 queries that gradient accumulation and pipelining need:
``FSDPModule.has_pending_gradients``, ``FSDPModule.unsharded_parameters`` and
``FSDPModule.is_fsdp_root`` (with ``reset_iter_state`` before lazy
initialization: test_fully_shard_is_fsdp_root.py).

Every multi-process test runs gloo on CPU through ``GlooMultiProcessTestCase``
(``FSDPTest`` skips every test on a CPU-only machine in torch 2.15.0).
"""

import copy
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.testing._internal.common_utils import run_tests


sys.path.insert(
    0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
)
from fsdp_lifecycle_testing import (  # noqa: E402
    CollectiveCounter,
    GlooMultiProcessTestCase,
)


DIM = 8
LR = 0.1


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin0 = nn.Linear(DIM, DIM)
        self.lin1 = nn.Linear(DIM, DIM)
        # A parameter FSDP does not manage (``ignored_params``)
        self.scale = nn.Parameter(torch.ones(DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin1(torch.tanh(self.lin0(x))) * self.scale


class TestFullyShardPendingGradients(GlooMultiProcessTestCase):
    def _build(self) -> tuple[Model, Model]:
        torch.manual_seed(0)
        ref_model = Model()
        model = copy.deepcopy(ref_model)
        mesh = init_device_mesh("cpu", (self.world_size,))
        fully_shard(model.lin0, mesh=mesh)
        fully_shard(model.lin1, mesh=mesh)
        fully_shard(model, mesh=mesh, ignored_params={model.scale})
        return model, ref_model

    def _batch(self, step: int, microbatch: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(10 * step + microbatch)
        return torch.randn(2 * self.world_size, DIM, generator=gen)

    def test_has_pending_gradients_across_accumulation(self):
        """
        A training loop that accumulates two microbatches without gradient
        sync before a synced one: gradients are pending exactly between the
        first backward and the reducing backward, per module with
        ``recurse=False``; the reduced gradients and the parameters after each
        optimizer step equal a single-process reference.
        """
        model, ref_model = self._build()
        optim = torch.optim.SGD(model.parameters(), lr=LR)
        ref_optim = torch.optim.SGD(ref_model.parameters(), lr=LR)
        self.assertFalse(model.has_pending_gradients())  # before lazy init
        counter = CollectiveCounter()
        for step in range(3):
            for microbatch in range(3):
                last = microbatch == 2
                model.set_requires_gradient_sync(last)
                x = self._batch(step, microbatch)
                local_x = x.chunk(self.world_size)[self.rank]
                counter.reset()
                with counter.count():
                    model(local_x).sum().backward()
                ref_model(x).sum().div(self.world_size).backward()
                self.assertEqual(counter["reduce_scatter"], 2 if last else 0)
                self.assertEqual(model.has_pending_gradients(), not last)
                self.assertEqual(
                    model.lin0.has_pending_gradients(recurse=False), not last
                )
                # The root's own group manages no parameters
                self.assertFalse(model.has_pending_gradients(recurse=False))
            for name, param in model.named_parameters():
                ref_grad = dict(ref_model.named_parameters())[name].grad
                if name == "scale":
                    # Not managed by FSDP: local gradients, not reduced
                    continue
                self.assertEqual(param.grad.full_tensor(), ref_grad, msg=name)
            dist.all_reduce(model.scale.grad)
            model.scale.grad.div_(self.world_size)
            optim.step()
            ref_optim.step()
            optim.zero_grad()
            ref_optim.zero_grad()
            for name, ref_param in ref_model.named_parameters():
                param = dict(model.named_parameters())[name]
                full = param.full_tensor() if name != "scale" else param
                self.assertEqual(full, ref_param, msg=f"step {step} {name}")

    def test_has_pending_gradients_manual_finalization(self):
        """
        Under manual backward finalization, gradients are pending after
        backward until ``finalize_backward`` (and its asynchronous handle's
        ``wait``); ``reset_iter_state`` discards no-sync gradients, so none are
        pending after it.
        """
        model, _ = self._build()
        model.set_manual_backward_finalization(True)
        for async_op in (False, True):
            model(self._batch(0, 0)).sum().backward()
            self.assertTrue(model.has_pending_gradients())
            if async_op:
                handle = model.finalize_backward(async_op=True)
                self.assertTrue(model.has_pending_gradients())
                handle.wait()
            else:
                model.finalize_backward()
            self.assertFalse(model.has_pending_gradients())
        model.set_manual_backward_finalization(False)

        model.set_requires_gradient_sync(False)
        model(self._batch(0, 1)).sum().backward()
        self.assertTrue(model.has_pending_gradients())
        self.assertTrue(model.lin1.has_pending_gradients(recurse=False))
        model.reset_iter_state()
        self.assertFalse(model.has_pending_gradients())

    def test_unsharded_parameters(self):
        """
        ``unsharded_parameters`` returns the parameters forward computed with
        (the autograd leaves whose ``.grad`` backward accumulates), also after
        ``reshard_after_forward=True`` registered the sharded parameters
        again, plus ignored parameters as registered; before the first forward
        it returns only the parameters FSDP does not manage, never a sharded
        one (revision 3 returned the sharded parameters).
        """
        model, ref_model = self._build()
        self.assertEqual(
            [id(p) for p in model.unsharded_parameters()], [id(model.scale)]
        )
        model.set_requires_gradient_sync(False)
        x = self._batch(0, 0)
        out = model(x)
        unsharded = list(model.unsharded_parameters())
        names = [name for name, _ in ref_model.named_parameters()]
        self.assertEqual(len(unsharded), len(names))
        registered = dict(model.named_parameters())
        for name, param in zip(names, unsharded):
            if name == "scale":
                self.assertIs(param, registered[name])
            else:
                # lin0 and lin1 resharded after forward
                self.assertIsNot(param, registered[name])
                self.assertEqual(
                    param.shape, dict(ref_model.named_parameters())[name].shape
                )
        # They are the leaves of forward's autograd graph: backward accumulates
        # this rank's (unreduced, no-sync) gradients into them
        out.sum().backward()
        ref_model(x).sum().backward()
        for name, param in zip(names, unsharded):
            ref_grad = dict(ref_model.named_parameters())[name].grad
            self.assertEqual(param.grad, ref_grad, msg=name)
        self.assertEqual(
            [id(p) for p in model.lin0.unsharded_parameters(recurse=False)],
            [id(unsharded[names.index(f"lin0.{n}")]) for n in ("weight", "bias")],
        )
        model.reset_iter_state()

    def test_recurse_and_frozen_groups(self):
        """
        ``recurse`` has one meaning for both queries, that of
        :meth:`nn.Module.parameters`: on a root whose parameter group holds
        only ``lin0``'s parameters (a plain submodule), ``recurse=False``
        checks and yields only the parameters registered on the root itself
        (here the frozen, ignored ``scale``), and ``recurse=True`` the whole
        subtree. A group whose
        parameters are all frozen (``lin1``) never has pending gradients, also
        after a no-sync backward. Revision 3: the root said pending with
        ``recurse=False`` while ``unsharded_parameters(recurse=False)`` was
        empty, and the frozen group said pending. Several accumulation steps
        match a reference.
        """
        torch.manual_seed(0)
        ref_model = Model()
        ref_model.lin1.requires_grad_(False)
        ref_model.scale.requires_grad_(False)
        model = copy.deepcopy(ref_model)
        mesh = init_device_mesh("cpu", (self.world_size,))
        fully_shard(model.lin1, mesh=mesh)
        # The root's group holds lin0's parameters
        fully_shard(model, mesh=mesh, ignored_params={model.scale})
        optim = torch.optim.SGD(
            [p for p in model.parameters() if p.requires_grad], lr=LR
        )
        ref_optim = torch.optim.SGD(
            [p for p in ref_model.parameters() if p.requires_grad], lr=LR
        )
        for step in range(3):
            for microbatch in range(2):
                last = microbatch == 1
                model.set_requires_gradient_sync(last)
                x = self._batch(step, microbatch)
                model(x.chunk(self.world_size)[self.rank]).sum().backward()
                ref_model(x).sum().div(self.world_size).backward()
                self.assertEqual(model.has_pending_gradients(), not last)
                # Registered on the root itself: only the unmanaged ``scale``
                self.assertEqual(
                    list(model.unsharded_parameters(recurse=False)), [model.scale]
                )
                self.assertFalse(model.has_pending_gradients(recurse=False))
                # The frozen group
                for recurse in (True, False):
                    self.assertFalse(
                        model.lin1.has_pending_gradients(recurse=recurse)
                    )
                self.assertEqual(
                    len(list(model.lin1.unsharded_parameters(recurse=False))), 2
                )
            for name, param in model.named_parameters():
                ref_param = dict(ref_model.named_parameters())[name]
                if ref_param.grad is None:
                    self.assertIsNone(param.grad, name)
                else:
                    self.assertEqual(
                        param.grad.full_tensor(), ref_param.grad, msg=name
                    )
            optim.step()
            ref_optim.step()
            optim.zero_grad()
            ref_optim.zero_grad()


if __name__ == "__main__":
    run_tests()
