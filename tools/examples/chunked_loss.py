"""
Chunked cross-entropy loss on FSDP2 with ``partial_backward`` and
``finish_forward`` (pytorch/pytorch#203176).

A chunked loss never materializes the full ``[batch, seq, vocab]`` logits: the
model's forward returns the hidden state, and the loss runs the output head
one sequence chunk at a time, each chunk with its own backward on a detached
hidden state. One backward through the decoder then follows with the
concatenated chunk gradients. This is the shape a torchtitan
``ChunkedLossWrapper`` takes:

- ``model.lm_head.partial_backward(outer_backward=...)`` scopes the per-chunk
  backwards: each touches only the head, which stays unsharded across the
  chunks and accumulates without reducing; the decoder backward (or, with a
  frozen decoder, the scope's exit) reduces every gradient once, per the
  caller's policy.
- ``model.lm_head.finish_forward(logits)`` completes the head group's forward
  when a chunk call ran only some of its modules (here ``lm_head`` of
  ``fully_shard([norm, lm_head])``, whose ``norm`` ran in the root forward).

Gradient accumulation over microbatches defers reduction with
``model.fsdp_policy(requires_gradient_sync=..., is_last_backward=...)``.

Runs on CPU with gloo, forking its own ranks::

    python tools/examples/chunked_loss.py --num-chunks 4 --microbatches 2 --steps 3

Each step prints the chunked loss next to a non-chunked run of the same model
(full logits, one backward), and the collectives each issued.
"""

import argparse
import collections
import contextlib
import copy
import os
import tempfile
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


VOCAB_SIZE, DIM, NUM_LAYERS = 128, 32, 2
BATCH_SIZE, SEQ_LEN = 2, 16


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x))


class Transformer(nn.Module):
    """A decoder that returns the final hidden state; the loss runs ``lm_head``."""

    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB_SIZE, DIM)
        self.layers = nn.ModuleList([Block() for _ in range(NUM_LAYERS)])
        self.norm = nn.LayerNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB_SIZE, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.norm(h)


def cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, scale: float
) -> torch.Tensor:
    return (
        F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum")
        * scale
    )


def chunked_loss_backward(
    model: Transformer,
    tokens: torch.Tensor,
    labels: torch.Tensor,
    *,
    num_chunks: int,
    scale: float,
) -> torch.Tensor:
    """Forward and backward of one microbatch with a chunked loss; returns the loss."""
    h = model(tokens)
    # Detach per chunk so each chunk's backward stops at the hidden state
    h_chunks = [
        c.detach().requires_grad_(h.requires_grad) for c in h.chunk(num_chunks, dim=1)
    ]
    loss = torch.zeros(())
    # ``outer_backward=False`` when nothing else runs backward (frozen decoder)
    with model.lm_head.partial_backward(outer_backward=h.requires_grad):
        for h_chunk, label_chunk in zip(h_chunks, labels.chunk(num_chunks, dim=1)):
            logits = model.lm_head.finish_forward(model.lm_head(h_chunk))
            chunk_loss = cross_entropy(logits, label_chunk, scale)
            chunk_loss.backward()
            loss += chunk_loss.detach()
    if h.requires_grad:
        h.backward(torch.cat([c.grad for c in h_chunks], dim=1))
    return loss


def full_loss_backward(
    model: Transformer, tokens: torch.Tensor, labels: torch.Tensor, *, scale: float
) -> torch.Tensor:
    """The non-chunked reference: full logits, one backward."""
    logits = model.lm_head.finish_forward(model.lm_head(model(tokens)))
    loss = cross_entropy(logits, labels, scale)
    loss.backward()
    return loss.detach()


@contextlib.contextmanager
def count_collectives(counts: collections.Counter) -> Iterator[None]:
    """Counts FSDP's collectives by wrapping the ``torch.distributed`` calls."""
    names = {
        "all_gather_single": "ag",
        "reduce_scatter_single": "rs",
        "all_reduce": "ar",
    }
    originals = {name: getattr(dist, name) for name in names}

    def wrap(name):
        def wrapper(*args, **kwargs):
            counts[names[name]] += 1
            return originals[name](*args, **kwargs)

        return wrapper

    try:
        for name in names:
            setattr(dist, name, wrap(name))
        yield
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def shard(model: Transformer) -> Transformer:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard([model.norm, model.lm_head], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def train(
    rank: int, world_size: int, store_path: str, args: argparse.Namespace
) -> None:
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = Transformer()
    reference = shard(copy.deepcopy(model))
    model = shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_optim = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(rank)
    # Each rank's loss is its mean over all its microbatches' tokens
    scale = 1.0 / (BATCH_SIZE * SEQ_LEN * args.microbatches)

    for step in range(1, args.steps + 1):
        losses = torch.zeros(2)
        counts: list[collections.Counter] = [
            collections.Counter(),
            collections.Counter(),
        ]
        for mb in range(args.microbatches):
            tokens = torch.randint(0, VOCAB_SIZE, (BATCH_SIZE, SEQ_LEN), generator=gen)
            labels = torch.randint(0, VOCAB_SIZE, (BATCH_SIZE, SEQ_LEN), generator=gen)
            # Reduce gradients only on the last microbatch of the step
            is_last = mb == args.microbatches - 1
            for i, m in enumerate((model, reference)):
                with (
                    m.fsdp_policy(
                        requires_gradient_sync=is_last,
                        recurse=True,
                        is_last_backward=is_last,
                    ),
                    count_collectives(counts[i]),
                ):
                    if m is model:
                        losses[i] += chunked_loss_backward(
                            m, tokens, labels, num_chunks=args.num_chunks, scale=scale
                        )
                    else:
                        losses[i] += full_loss_backward(m, tokens, labels, scale=scale)
        for opt in (optim, ref_optim):
            opt.step()
            opt.zero_grad()
        dist.all_reduce(losses, op=dist.ReduceOp.AVG)
        if rank == 0:
            chunked, full = counts
            print(
                f"step {step}: loss {losses[0].item():.6f} "
                f"(non-chunked {losses[1].item():.6f}) | chunked: "
                f"reduce-scatter {chunked['rs']}, all-gather {chunked['ag']}, "
                f"all-reduce {chunked['ar']} | non-chunked: "
                f"reduce-scatter {full['rs']}, all-gather {full['ag']}, "
                f"all-reduce {full['ar']}",
                flush=True,
            )
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--num-chunks", type=int, default=4, help="loss chunks per microbatch"
    )
    parser.add_argument(
        "--microbatches", type=int, default=2, help="microbatches per optimizer step"
    )
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps")
    parser.add_argument(
        "--world-size", type=int, default=2, help="number of gloo ranks"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp_dir:
        mp.start_processes(
            train,
            args=(args.world_size, os.path.join(tmp_dir, "store"), args),
            nprocs=args.world_size,
            start_method="fork",
        )


if __name__ == "__main__":
    main()
