"""
Shared pieces of the benchmarks in ``tools/bench``: a tiny decoder-only LM
whose forward stops before ``lm_head`` (and its pipeline stages), the FSDP/HSDP
layouts with the size of each FSDP group, the four step methods compared, and
a fork-based gloo launcher. Collectives are counted by :mod:`counting`, result
files written by :mod:`results` and tables rendered by :mod:`render`.

The four methods (one optimizer step = ``M`` microbatches; gradients are
reduced on the last one only, the caller's policy for the others is "no
sync"):

``a``  the public API of this series: ``fsdp_policy(...)`` for deferral,
       ``lm_head.partial_backward()`` + ``lm_head.finish_forward()`` for the
       chunks (needs the patched torch);
``b``  torchtitan's own ``ChunkedLossWrapper`` (``torchtitan.components.loss``),
       with the caller's deferral through the existing setters; the wrapper
       forces ``lm_head`` gradient sync on its last chunk and sets sync (and,
       under HSDP, the replica all-reduce) back on when it exits;
``c``  unpatched torch with a chunked wrapper that keeps the head unsharded
       across chunks and then restores the caller's policy through the
       existing setters (it must be told the caller's policy: 2.15.0 has no
       getters);
``d``  no chunking: full logits, one backward.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from render import HEADS  # noqa: F401  (one list of heads for the scripts and the tables)



def has_series_api() -> bool:
    return hasattr(FSDPModule, "partial_backward") and hasattr(FSDPModule, "fsdp_policy")


# --------------------------------------------------------------------------- model


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, 2 * dim)
        self.w2 = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.w2(F.gelu(self.w1(x)))


class TinyLM(nn.Module):
    """A decoder whose forward returns the final hidden state; the loss runs ``lm_head``."""

    def __init__(self, *, vocab_size: int, dim: int, num_layers: int, tied: bool = False) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab_size, dim)
        self.layers = nn.ModuleList([Block(dim) for _ in range(num_layers)])
        self.norm = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab_size, bias=False)
        if tied:
            self.lm_head.weight = self.tok_embeddings.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.norm(h)


def shard(model: TinyLM, *, head: str, mesh, **fsdp_kwargs) -> int:
    """Applies FSDP (1-D mesh) or HSDP (2-D mesh), with ``fsdp_kwargs`` (e.g. ``mp_policy``) for every
    group; returns the number of FSDP groups with params."""
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, **fsdp_kwargs)
    if head == "separate":
        fully_shard(model.lm_head, mesh=mesh, **fsdp_kwargs)
    elif head == "grouped":
        fully_shard([model.norm, model.lm_head], mesh=mesh, **fsdp_kwargs)
    elif head == "tied":
        # A tied weight must live in one group with both of its users
        fully_shard([model.tok_embeddings, model.lm_head], mesh=mesh, **fsdp_kwargs)
    else:
        raise ValueError(head)
    fully_shard(model, mesh=mesh, **fsdp_kwargs)
    # layers + head group + root (root keeps embeddings and/or norm)
    return len(model.layers) + 2


def make_mesh(kind: str, device_type: str = "cpu"):
    world = dist.get_world_size()
    if kind == "hsdp":
        return init_device_mesh(device_type, (2, world // 2), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh(device_type, (world,))


def group_label(model: TinyLM):
    """``label_of(param_group)`` for :meth:`counting.CallLog.count`: ``head`` (the group holding
    ``lm_head``), ``layer`` (a decoder block) or ``root``."""
    def label_of(group) -> str:
        modules = getattr(group, "modules", ())
        if any(m is model.lm_head for m in modules):
            return "head"
        if any(isinstance(m, Block) for m in modules):
            return "layer"
        return "root"

    return label_of


class Stage(nn.Module):
    """A pipeline stage cut from a :class:`TinyLM`: embeddings on the first, norm and head on the last."""

    def __init__(self, model: TinyLM, layer_ids, *, first: bool, last: bool) -> None:
        super().__init__()
        self.tok_embeddings = model.tok_embeddings if first else None
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in layer_ids})
        self.norm = model.norm if last else None
        # The chunked loss applies the head; forward stops before it
        self.lm_head = model.lm_head if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tok_embeddings is not None:
            x = self.tok_embeddings(x)
        for layer in self.layers.values():
            x = layer(x)
        return self.norm(x) if self.norm is not None else x


# --------------------------------------------------------------------------- steps


def _ce(logits: torch.Tensor, labels: torch.Tensor, scale: float) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum") * scale


def microbatch_a(model, tokens, labels, *, num_chunks, scale, last):
    """(a) the series' public API."""
    with model.fsdp_policy(requires_gradient_sync=last, recurse=True, is_last_backward=last):
        h = model(tokens)
        h_chunks = [c.detach().requires_grad_(True) for c in h.chunk(num_chunks, dim=1)]
        total = torch.zeros((), device=h.device)
        with model.lm_head.partial_backward(outer_backward=True):
            for h_chunk, label_chunk in zip(h_chunks, labels.chunk(num_chunks, dim=1)):
                logits = model.lm_head.finish_forward(model.lm_head(h_chunk))
                loss = _ce(logits, label_chunk, scale)
                loss.backward()
                total += loss.detach()
        h.backward(torch.cat([c.grad for c in h_chunks], dim=1))
    return total


def _set_caller_policy(model, last: bool) -> None:
    # The caller's deferral through the existing 2.15.0 setters
    model.set_requires_gradient_sync(last)
    model.set_is_last_backward(last)


def make_microbatch_b(num_chunks: int, tokens_per_step: int, wrapper_cls=None):
    """(b) torchtitan's ChunkedLossWrapper, unchanged (or ``wrapper_cls``, another version of it)."""
    if wrapper_cls is None:
        from torchtitan.components.loss import ChunkedLossWrapper as wrapper_cls

    wrapper = wrapper_cls(wrapper_cls.Config(num_chunks=num_chunks))
    gvt = torch.tensor(float(tokens_per_step))

    def microbatch_b(model, tokens, labels, *, num_chunks, scale, last):
        if wrapper.lm_head is None:
            wrapper.set_lm_head(model.lm_head)
        _set_caller_policy(model, last)
        loss, _ = wrapper(model(tokens), labels, gvt)
        loss.backward()
        return loss.detach()

    return microbatch_b


def microbatch_c(model, tokens, labels, *, num_chunks, scale, last):
    """(c) 2.15.0 with a wrapper that restores the caller's policy via the setters."""
    _set_caller_policy(model, last)
    head = model.lm_head
    h = model(tokens)
    h_chunks = [c.detach().requires_grad_(True) for c in h.chunk(num_chunks, dim=1)]
    total = torch.zeros((), device=h.device)
    # Keep the head unsharded and unreduced across chunks
    head.set_reshard_after_forward(False)
    head.set_reshard_after_backward(False)
    head.set_requires_gradient_sync(False, recurse=False)
    try:
        for h_chunk, label_chunk in zip(h_chunks, labels.chunk(num_chunks, dim=1)):
            loss = _ce(head(h_chunk), label_chunk, scale)
            loss.backward()
            total += loss.detach()
    finally:
        # Restore what the caller set (2.15.0 has no getters: the wrapper is
        # told). set_requires_gradient_sync(x) also sets the HSDP all-reduce to x.
        head.set_reshard_after_forward(True)
        head.set_reshard_after_backward(True)
        head.set_requires_gradient_sync(last, recurse=False)
    h.backward(torch.cat([c.grad for c in h_chunks], dim=1))
    return total


def microbatch_d(model, tokens, labels, *, num_chunks, scale, last):
    """(d) full logits, one backward; the same code on both torches (existing setters)."""
    _set_caller_policy(model, last)
    loss = _ce(model.lm_head(model(tokens)), labels, scale)
    loss.backward()
    return loss.detach()


def microbatch_fn(method: str, *, num_chunks: int, tokens_per_step: int) -> Callable:
    if method == "b":
        return make_microbatch_b(num_chunks, tokens_per_step)
    return {"a": microbatch_a, "c": microbatch_c, "d": microbatch_d}[method]


# --------------------------------------------------------------------------- arguments

#: The step's shape, shared by the scripts' arguments and their result files.
STEP_SHAPE = ("microbatches", "num_chunks", "vocab", "dim", "layers", "batch", "seq")


def add_step_args(p: argparse.ArgumentParser, *, vocab: int, dim: int, batch: int, seq: int) -> None:
    """The chunked-loss step's shape (M=3 microbatches, N=4 chunks, 2 layers by default),
    ``--no-torchtitan`` and ``--json``."""
    p.add_argument("--microbatches", type=int, default=3)
    p.add_argument("--num-chunks", type=int, default=4)
    p.add_argument("--vocab", type=int, default=vocab)
    p.add_argument("--dim", type=int, default=dim)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=batch)
    p.add_argument("--seq", type=int, default=seq)
    p.add_argument("--no-torchtitan", action="store_true", help="skip method b")
    p.add_argument("--json", type=Path, help="write the results here")


def step_params(args, *extra: str) -> dict:
    return {k: getattr(args, k) for k in (*STEP_SHAPE, *extra)}


def runnable(methods: list[str], *, no_torchtitan: bool) -> list[str]:
    """``methods`` without b when torchtitan is unwanted or not importable."""
    if "b" not in methods:
        return methods
    if not no_torchtitan:
        try:
            import torchtitan.components.loss  # noqa: F401

            return methods
        except Exception as e:
            print(f"torchtitan not importable ({type(e).__name__}: {e}); skipping method b")
    return [m for m in methods if m != "b"]


# --------------------------------------------------------------------------- launcher


def _worker(rank, world_size, store_path, fn, args, out_dir, backend="gloo"):
    if backend == "fake":  # one process standing for rank 0 of a world that does no communication
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    else:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, store=dist.FileStore(store_path, world_size), rank=rank,
                                world_size=world_size)
    torch.set_num_threads(1)
    try:
        result = fn(rank, world_size, *args)
        if rank == 0:
            Path(out_dir, "result.json").write_text(json.dumps(result))
    except Exception:
        if rank == 0:
            Path(out_dir, "result.json").write_text(json.dumps({"error": traceback.format_exc()}))
        raise
    finally:
        dist.destroy_process_group()


def launch(fn, world_size: int, *args, backend: str = "gloo", start_method: str = "fork"):
    """Runs ``fn(rank, world_size, *args)`` on ``world_size`` ranks of ``backend`` (forked gloo ranks by
    default; ``"nccl"``: one GPU per rank, with ``start_method="spawn"``; ``"fake"``: a single process,
    rank 0 of torch's fake process group of ``world_size``); returns rank 0's result."""
    nprocs = 1 if backend == "fake" else world_size
    with tempfile.TemporaryDirectory() as tmp:
        try:
            mp.start_processes(_worker, args=(world_size, os.path.join(tmp, "store"), fn, args, tmp, backend),
                               nprocs=nprocs, start_method=start_method)
        except Exception as e:  # a rank raised: report rank 0's traceback if it has one
            path = Path(tmp, "result.json")
            if path.exists():
                return json.loads(path.read_text())
            return {"error": f"{type(e).__name__}: {e}"}
        return json.loads(Path(tmp, "result.json").read_text())
