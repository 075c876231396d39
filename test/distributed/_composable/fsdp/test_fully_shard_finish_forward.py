# Owner(s): ["oncall: distributed"]
"""
Tests for ``FSDPModule.finish_forward``: a grouped head
(``fully_shard([norm, lm_head])``) called per chunk as ``lm_head(h_chunk)``
after the root forward ran ``norm``, one backward over the chunk losses.
With ``finish_forward`` each chunk's partial group forward is completed, so
the group is reduced like the non-chunked call, also with a frozen decoder,
and evaluation leaves no state behind.
"""

import copy
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState
from torch.testing._internal.common_utils import (
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
)


sys.path.insert(
    0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
)
from fsdp_lifecycle_testing import (  # noqa: E402
    CollectiveCounter,
    fsdp_states,
    GlooMultiProcessTestCase,
    random_token_microbatches,
)


VOCAB_SIZE, DIM, SEQ_LEN, BATCH_SIZE = 32, 16, 12, 2
NUM_MICROBATCHES, NUM_CHUNKS, NUM_STEPS = 2, 3, 2


class Transformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB_SIZE, DIM)
        self.layers = nn.ModuleList([nn.Linear(DIM, DIM) for _ in range(2)])
        self.norm = nn.LayerNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB_SIZE, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = h + torch.tanh(layer(h))
        return self.norm(h)  # ``lm_head`` runs per chunk, outside


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")


class TestFullyShardFinishForward(GlooMultiProcessTestCase):
    @property
    def world_size(self) -> int:
        return 2

    @parametrize("training", ["full", "frozen_decoder"])
    def test_chunked_head_reduces_like_non_chunked(self, training: str):
        """
        Chunked calls completed with ``finish_forward`` reduce-scatter as often
        as the non-chunked call, and both match a single-process reference
        over several SGD steps; with a frozen decoder the head's gradients are
        reduced too (without ``finish_forward`` the chunk outputs carry no
        pre-backward hook and the head's gradients never reach ``.grad``).
        """
        torch.manual_seed(42)
        ref = Transformer()
        if training == "frozen_decoder":
            for module in (ref.tok_embeddings, ref.layers):
                module.requires_grad_(False)
        models = {}
        for chunked in (False, True):
            model = copy.deepcopy(ref)
            for layer in model.layers:
                fully_shard(layer)
            fully_shard([model.norm, model.lm_head])
            fully_shard(model)
            models[chunked] = model
        params = {
            key: [p for p in m.parameters() if p.requires_grad]
            for key, m in (*models.items(), ("ref", ref))
        }
        optims = {k: torch.optim.SGD(p, lr=0.1) for k, p in params.items()}
        for step in range(NUM_STEPS):
            tokens, labels = random_token_microbatches(
                100 * step + self.rank,
                NUM_MICROBATCHES,
                VOCAB_SIZE,
                BATCH_SIZE,
                SEQ_LEN,
            )
            all_tokens = [None] * self.world_size
            all_labels = [None] * self.world_size
            torch.distributed.all_gather_object(all_tokens, tokens)
            torch.distributed.all_gather_object(all_labels, labels)
            for rank_tokens, rank_labels in zip(all_tokens, all_labels):
                for mb_tokens, mb_labels in zip(rank_tokens, rank_labels):
                    loss = _loss(ref.lm_head(ref(mb_tokens)), mb_labels)
                    (loss / self.world_size).backward()
            counts = {}
            for chunked, model in models.items():
                counter = CollectiveCounter()
                with counter.count():
                    for mb in range(NUM_MICROBATCHES):
                        h = model(tokens[mb])
                        chunks = h.chunk(NUM_CHUNKS, dim=1) if chunked else [h]
                        label_chunks = labels[mb].chunk(len(chunks), dim=1)
                        loss = sum(
                            _loss(model.lm_head.finish_forward(model.lm_head(c)), y)
                            for c, y in zip(chunks, label_chunks)
                        )
                        loss.backward()
                counts[chunked] = counter["reduce_scatter"]
                for param, ref_param in zip(params[chunked], params["ref"]):
                    torch.testing.assert_close(
                        param.grad.full_tensor(), ref_param.grad, atol=1e-5, rtol=1e-5
                    )
            # The chunked calls reduce as the non-chunked call does (the
            # grouped head's post-backward runs once per group forward input,
            # as on 2.15.0)
            self.assertEqual(counts[True], counts[False])
            self.assertGreater(counts[True], 0)
            for optim in optims.values():
                optim.step()
                optim.zero_grad()

    def test_evaluation_leaves_no_state(self):
        """
        ``no_grad`` chunk calls completed with ``finish_forward`` leave the head
        group sharded and every state idle, batch after batch.
        """
        torch.manual_seed(42)
        model = Transformer()
        for layer in model.layers:
            fully_shard(layer)
        fully_shard([model.norm, model.lm_head])
        fully_shard(model)
        (head,) = model.lm_head._get_fsdp_state()._fsdp_param_groups
        gen = torch.Generator().manual_seed(self.rank)
        for _ in range(5):
            tokens = torch.randint(0, VOCAB_SIZE, (BATCH_SIZE, SEQ_LEN), generator=gen)
            with torch.no_grad():
                h = model(tokens)
                for c in h.chunk(NUM_CHUNKS, dim=1):
                    model.lm_head.finish_forward(model.lm_head(c))
            self.assertTrue(head.is_sharded)
            for state in fsdp_states(model):
                self.assertEqual(state._training_state, TrainingState.IDLE)
                self.assertEqual(len(state._modules_to_run_forward), 0)
            self.assertIsNone(model._get_fsdp_state()._state_ctx.iter_forward_root)


    def test_docstring_evaluation_sentence_holds(self):
        """
        ``finish_forward``'s docstring describes its ``torch.no_grad()``
        bookkeeping exactly where the stack below it makes that true: with it,
        an evaluation loop whose per-chunk calls it completes leaves no
        post-forward order entry behind; without it (the evaluation bound is
        a later PR), the loop records the order like any forward. Revision 4
        said "only reshards and clears the bookkeeping" in this PR, where five
        evaluation batches left 35 entries.
        """
        from torch.distributed.fsdp import FSDPModule

        documented = "torch.no_grad()" in (FSDPModule.finish_forward.__doc__ or "")
        torch.manual_seed(42)
        model = Transformer()
        for layer in model.layers:
            fully_shard(layer)
        fully_shard([model.norm, model.lm_head])
        fully_shard(model)
        gen = torch.Generator().manual_seed(self.rank)
        with torch.no_grad():
            for _ in range(5):
                tokens = torch.randint(
                    0, VOCAB_SIZE, (BATCH_SIZE, SEQ_LEN), generator=gen
                )
                h = model(tokens)
                for c in h.chunk(NUM_CHUNKS, dim=1):
                    model.lm_head.finish_forward(model.lm_head(c))
        num_entries = len(model._get_fsdp_state()._comm_ctx.post_forward_order)
        self.assertEqual(
            documented,
            num_entries == 0,
            f"docstring describes torch.no_grad(): {documented}; post-forward "
            f"order entries after 5 evaluation batches: {num_entries}",
        )

instantiate_parametrized_tests(TestFullyShardFinishForward)


if __name__ == "__main__":
    run_tests()
