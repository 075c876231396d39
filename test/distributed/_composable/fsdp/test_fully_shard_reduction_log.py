# Owner(s): ["oncall: distributed"]
"""
Tests for FSDP's debug log line per gradient reduction,
``FSDP::post_backward_reduce (<module>)`` on the
``torch.distributed.fsdp.fully_shard`` logger (``TORCH_LOGS="+fsdp"``).

Every multi-process test runs gloo on CPU through ``GlooMultiProcessTestCase``
(``FSDPTest`` skips every test on a CPU-only machine in torch 2.15.0).
"""

import collections
import contextlib
import logging
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.testing._internal.common_utils import run_tests


sys.path.insert(
    0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
)
from fsdp_lifecycle_testing import GlooMultiProcessTestCase  # noqa: E402


VOCAB_SIZE, DIM, NUM_CHUNKS = 16, 8, 4
LOGGER = "torch.distributed.fsdp.fully_shard"
REDUCE = "FSDP::post_backward_reduce"


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB_SIZE, DIM)
        self.layer = nn.Linear(DIM, DIM)
        self.lm_head = nn.Linear(DIM, VOCAB_SIZE, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.layer(self.tok_embeddings(tokens)))


class TestFullyShardReductionLog(GlooMultiProcessTestCase):
    def _reductions_per_group(self, use_partial_backward: bool) -> collections.Counter:
        """Runs one chunked-loss step and counts the reduction log lines."""
        torch.manual_seed(0)
        model = Model()
        mesh = init_device_mesh("cpu", (self.world_size,))
        fully_shard(model.layer, mesh=mesh)
        fully_shard(model.lm_head, mesh=mesh)
        fully_shard(model, mesh=mesh)
        tokens = torch.randint(0, VOCAB_SIZE, (2, 8))
        with self.assertLogs(LOGGER, level=logging.DEBUG) as logs:
            h = model(tokens)
            h_chunks = [c.detach().requires_grad_() for c in h.chunk(NUM_CHUNKS, 1)]
            scope = (
                model.lm_head.partial_backward()
                if use_partial_backward
                else contextlib.nullcontext()
            )
            with scope:
                for h_chunk, label_chunk in zip(h_chunks, tokens.chunk(NUM_CHUNKS, 1)):
                    logits = model.lm_head(h_chunk)
                    F.cross_entropy(logits.flatten(0, 1), label_chunk.flatten()).backward()
            h.backward(torch.cat([c.grad for c in h_chunks], dim=1))
        return collections.Counter(
            record.getMessage()
            for record in logs.records
            if record.getMessage().startswith(REDUCE)
        )

    def test_one_line_per_reduction(self):
        """
        With ``partial_backward`` every group reduces once per step, and the
        log has one line per group; without it, the separately sharded head
        reduces once per chunk, and the log shows each of those reductions.
        """
        once = {f"{REDUCE} (lm_head)": 1, f"{REDUCE} (layer)": 1, REDUCE: 1}
        self.assertEqual(self._reductions_per_group(True), once)
        self.assertEqual(
            self._reductions_per_group(False),
            {**once, f"{REDUCE} (lm_head)": NUM_CHUNKS},
        )

    def test_no_line_without_reduction(self):
        """A backward under no-sync reduces nothing and logs no reduction."""
        torch.manual_seed(0)
        model = Model()
        mesh = init_device_mesh("cpu", (self.world_size,))
        fully_shard(model.layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.set_requires_gradient_sync(False)
        with self.assertLogs(LOGGER, level=logging.DEBUG) as logs:
            model.lm_head(model(torch.randint(0, VOCAB_SIZE, (2, 8)))).sum().backward()
        messages = [record.getMessage() for record in logs.records]
        self.assertIn("FSDP::post_backward (layer)", messages)
        self.assertFalse([m for m in messages if m.startswith(REDUCE)], messages)


if __name__ == "__main__":
    run_tests()
