# Owner(s): ["oncall: distributed"]
"""
Gradient accumulation under ``set_manual_backward_finalization(True)`` with
only torch 2.15.0's APIs: the root post-backward final callback leaves the
iteration to ``finalize_backward()`` also when ``is_last_backward`` is set,
as on 2.15.0, so each microbatch's backward prefetches along the post-forward
order of the whole accumulation and the all-gathers per microbatch are
2.15.0's. Gradients are compared with a float64 single-process reference
over several optimizer steps.

Gloo on CPU through ``GlooMultiProcessTestCase`` (``FSDPTest`` skips every
test on a CPU-only machine in torch 2.15.0).
"""

import collections
import copy
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.fsdp._fully_shard import _fsdp_param_group
from torch.distributed.tensor import DTensor
from torch.testing._internal.common_utils import run_tests


sys.path.insert(
    0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
)
from fsdp_lifecycle_testing import GlooMultiProcessTestCase  # noqa: E402


VOCAB, DIM, BATCH, SEQ = 16, 8, 2, 4
NUM_MICROBATCHES = 3
NUM_STEPS = 2
LR = 0.1


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x))


class Transformer(nn.Module):
    """The norm runs in the root's forward, the heads after it (the loss
    applies ``lm_head`` and the auxiliary ``mtp`` head to its output)."""

    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList([Block(), Block()])
        self.norm = nn.LayerNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
        self.mtp = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.norm(h)


def _loss(model: nn.Module, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    h = model(tokens)
    loss = F.cross_entropy(model.lm_head(h).flatten(0, 1), labels.flatten())
    aux = F.cross_entropy(model.mtp(h).flatten(0, 1), labels.roll(1, 1).flatten())
    return (loss + aux) / NUM_MICROBATCHES


def _data(step: int, rank: int, microbatch: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + 10 * rank + microbatch)
    return (
        torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen),
        torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen),
    )


class TestFullyShardManualFinalization(GlooMultiProcessTestCase):
    @property
    def world_size(self) -> int:
        return 2

    def test_accumulation_keeps_iteration_until_finalize(self):
        """
        Three microbatches (no-sync, no-sync, sync), each ending with
        ``is_last_backward`` at its default, then ``finalize_backward()``:
        the all-gathers per microbatch are 2.15.0's (the second microbatch's
        backward prefetches the auxiliary head along the order its first
        microbatch recorded, which a final callback that ended the iteration
        would have cleared), and the gradients are the reference's. Passes on
        2.15.0 (no API of the series is called).
        """
        torch.manual_seed(0)
        model = Transformer()
        ref = copy.deepcopy(model).double()
        mesh = init_device_mesh("cpu", (self.world_size,))
        fully_shard(model.mtp, mesh=mesh)
        fully_shard([model.norm, model.lm_head], mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.set_manual_backward_finalization(True)
        optim = torch.optim.SGD(model.parameters(), lr=LR)
        ref_optim = torch.optim.SGD(ref.parameters(), lr=LR)

        all_gathers: list[collections.Counter[str]] = []
        orig_all_gather = _fsdp_param_group.foreach_all_gather

        def all_gather(fsdp_params, *args, **kwargs):
            all_gathers[-1][fsdp_params[0]._param_fqn.split(".")[0]] += 1
            return orig_all_gather(fsdp_params, *args, **kwargs)

        _fsdp_param_group.foreach_all_gather = all_gather
        try:
            for step in range(NUM_STEPS):
                all_gathers.clear()
                for mb in range(NUM_MICROBATCHES):
                    all_gathers.append(collections.Counter())
                    model.set_requires_gradient_sync(mb == NUM_MICROBATCHES - 1)
                    _loss(model, *_data(step, self.rank, mb)).backward()
                model.finalize_backward()
                # Measured on 2.15.0: the root group (embedding, blocks) is
                # all-gathered once per microbatch, the [norm, lm_head] group
                # in the forward, for lm_head after it and in backward, and
                # the auxiliary head in forward and backward, once more in
                # the second microbatch's backward
                self.assertEqual(
                    [dict(c) for c in all_gathers],
                    [
                        {"tok_embeddings": 1, "norm": 3, "mtp": 2},
                        {"tok_embeddings": 1, "norm": 3, "mtp": 3},
                        {"tok_embeddings": 1, "norm": 3, "mtp": 2},
                    ],
                    msg=f"step {step}",
                )
                for rank in range(self.world_size):
                    for mb in range(NUM_MICROBATCHES):
                        tokens, labels = _data(step, rank, mb)
                        (_loss(ref, tokens, labels) / self.world_size).backward()
                for (name, param), ref_param in zip(
                    model.named_parameters(), ref.parameters()
                ):
                    grad = param.grad
                    if isinstance(grad, DTensor):
                        grad = grad.full_tensor()
                    self.assertEqual(
                        grad.double(),
                        ref_param.grad,
                        atol=1e-5,
                        rtol=1e-4,
                        msg=f"step {step}: {name}",
                    )
                optim.step()
                optim.zero_grad()
                ref_optim.step()
                ref_optim.zero_grad()
        finally:
            _fsdp_param_group.foreach_all_gather = orig_all_gather


if __name__ == "__main__":
    run_tests()
