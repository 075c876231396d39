# Owner(s): ["oncall: distributed"]
"""
A forward-only iteration (a ``torch.no_grad()`` evaluation forward of the
root) leaves no post-forward order behind, so the next training backward
prefetches exactly as a training step that no evaluation preceded. On 2.15.0
the evaluation forward's entries stay in the order, and the next backward
issues one extra all-gather per stale entry it prefetches by.

Only 2.15.0's APIs are used, so the test runs unchanged on 2.15.0, where
``test_eval_loop_bounded`` fails: each evaluation forward leaves one entry per
group in the post-forward order (12 after three batches here).
"""

import copy
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard
from torch.testing._internal.common_utils import (
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
)
from torch.utils.checkpoint import checkpoint


sys.path.insert(
    0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
)
from fsdp_lifecycle_testing import (  # noqa: E402
    CollectiveCounter,
    GlooMultiProcessTestCase,
)


DIM = 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


class Model(nn.Module):
    def __init__(self, *, checkpointed: bool = False) -> None:
        super().__init__()
        self.embed = nn.Linear(DIM, DIM)
        self.body = nn.ModuleList([Block() for _ in range(2)])
        self.lm_head = nn.Linear(DIM, DIM)
        self.checkpointed = checkpointed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.body:
            if self.checkpointed and torch.is_grad_enabled():
                x = checkpoint(block, x, use_reentrant=True)
            else:
                x = block(x)
        return self.lm_head(x)


def _shard(model: Model) -> Model:
    for block in model.body:
        fully_shard(block)
    fully_shard(model.lm_head)
    fully_shard(model)
    return model


class TestFullyShardEvalOrder(GlooMultiProcessTestCase):
    @property
    def world_size(self) -> int:
        return 2

    def _backward_all_gathers(
        self, model: Model, inp: torch.Tensor, *, evaluate: bool
    ) -> int:
        if evaluate:
            with torch.no_grad():
                model(inp)
        loss = model(inp).square().mean()
        counter = CollectiveCounter()
        with counter.count():
            loss.backward()
        return counter["all_gather"]

    @parametrize("checkpointed", [False, True])
    def test_eval_forward_then_train_step(self, checkpointed: bool):
        """
        Two optimizer steps, each preceded by an evaluation forward: every
        step's backward all-gathers as often as one without the evaluation
        forward (3 here: the two blocks and the head are resharded after
        forward; with reentrant checkpointing the blocks' recomputed forwards
        are recorded as before), and the parameters match a model trained
        without evaluation forwards.
        """
        torch.manual_seed(0)
        model = Model(checkpointed=checkpointed)
        ref_model = copy.deepcopy(model)
        _shard(model)
        _shard(ref_model)
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        ref_optim = torch.optim.SGD(ref_model.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(self.rank)
        for step in range(2):
            inp = torch.randn(4, DIM, generator=gen)
            num_ref = self._backward_all_gathers(ref_model, inp, evaluate=False)
            num = self._backward_all_gathers(model, inp, evaluate=True)
            self.assertEqual(num, num_ref, f"step {step}")
            if not checkpointed:
                self.assertEqual(num_ref, 3, f"step {step}")
            for opt in (optim, ref_optim):
                opt.step()
                opt.zero_grad()
            for param, ref_param in zip(model.parameters(), ref_model.parameters()):
                self.assertEqual(param.full_tensor(), ref_param.full_tensor())
        dist.barrier()

    def test_eval_loop_bounded(self):
        """
        A loop of evaluation forwards leaves the post-forward order empty.
        """
        torch.manual_seed(0)
        model = _shard(Model())
        with torch.no_grad():
            for _ in range(3):
                model(torch.randn(4, DIM))
        self.assertEqual(len(model._get_fsdp_state()._comm_ctx.post_forward_order), 0)


instantiate_parametrized_tests(TestFullyShardEvalOrder)


if __name__ == "__main__":
    run_tests()
