"""
Shows how often each FSDP group reduces its gradients, through FSDP's debug log.

A chunked loss loop without ``partial_backward()`` trains to the same numbers
as one with it, but reduces the head's gradients once per chunk. FSDP logs one
``FSDP::post_backward_reduce (<module>)`` line per gradient reduction of a
group at debug level, so counting those lines per step shows it::

    TORCH_LOGS="+fsdp" python tools/examples/reduction_log.py 2>&1 \
        | grep -o "^\\[rank0\\].*FSDP::post_backward_reduce.*\\|^step.*"
    TORCH_LOGS="+fsdp" python tools/examples/reduction_log.py --no-partial-backward ...

Runs two CPU ranks with gloo; rank 0 prints ``step N`` after each step.
"""

import argparse
import contextlib
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


VOCAB_SIZE, DIM = 64, 16


class Model(nn.Module):
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
        return self.norm(h)  # the loss runs lm_head per chunk


def train(rank: int, world_size: int, store_path: str, args: argparse.Namespace) -> None:
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    torch.manual_seed(0)
    model = Model()
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model.lm_head, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(rank)
    for step in range(1, args.steps + 1):
        tokens = torch.randint(0, VOCAB_SIZE, (2, 8), generator=gen)
        labels = torch.randint(0, VOCAB_SIZE, (2, 8), generator=gen)
        h = model(tokens)
        h_chunks = [c.detach().requires_grad_() for c in h.chunk(args.chunks, dim=1)]
        scope = (
            contextlib.nullcontext()
            if args.no_partial_backward
            else model.lm_head.partial_backward()
        )
        with scope:
            for h_chunk, label_chunk in zip(h_chunks, labels.chunk(args.chunks, dim=1)):
                logits = model.lm_head(h_chunk)
                loss = F.cross_entropy(logits.flatten(0, 1), label_chunk.flatten())
                (loss / args.chunks).backward()
        h.backward(torch.cat([c.grad for c in h_chunks], dim=1))
        optim.step()
        optim.zero_grad()
        if rank == 0:
            # One write, and before the barrier: rank 1 logs nothing of the next
            # step until this line is out (``print`` writes the text and the
            # newline separately when stderr is unbuffered).
            sys.stderr.write(f"step {step}\n")
            sys.stderr.flush()
        dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument(
        "--no-partial-backward",
        action="store_true",
        help="run the chunk backwards without model.lm_head.partial_backward()",
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(train, args=(2, os.path.join(tmp, "store"), args), nprocs=2)


if __name__ == "__main__":
    main()
