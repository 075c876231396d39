"""
Step time of a chunked-loss optimizer step (benchmark 2): the series' API
(method ``a``) vs torchtitan's ``ChunkedLossWrapper`` (``b``) and the full
logits step (``d``), as ratios measured in the same run (same processes; the
methods alternate step by step so machine load hits them alike).

All methods run on the patched torch: the series changes nothing for code
that does not use it (``collectives.py`` checks ``b``'s losses and gradients
against unpatched 2.15.0). Median wall time of ``--steps`` optimizer steps per
method on rank 0 after ``--warmup`` steps; FSDP on 2 gloo ranks, grouped head.
Timing on a shared machine is noisy: read the ratios, not the absolute times.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import render  # noqa: E402
import results  # noqa: E402


def run(rank, world_size, args, methods):
    mesh = common.make_mesh("fsdp")
    tokens_per_step = args.batch * args.seq * args.microbatches
    setups = {}
    for method in methods:
        torch.manual_seed(0)
        model = common.TinyLM(vocab_size=args.vocab, dim=args.dim, num_layers=args.layers)
        common.shard(model, head=args.head, mesh=mesh)
        setups[method] = (model, torch.optim.SGD(model.parameters(), lr=0.01),
                          common.microbatch_fn(method, num_chunks=args.num_chunks,
                                               tokens_per_step=tokens_per_step))
    gen = torch.Generator().manual_seed(rank)
    times = {m: [] for m in methods}
    for step in range(args.warmup + args.steps):
        batches = [(torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen),
                    torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen))
                   for _ in range(args.microbatches)]
        order = methods if step % 2 == 0 else methods[::-1]
        for method in order:
            model, optim, fn = setups[method]
            dist.barrier()
            t0 = time.perf_counter()
            for mb, (tokens, labels) in enumerate(batches):
                fn(model, tokens, labels, num_chunks=args.num_chunks, scale=1.0 / tokens_per_step,
                   last=mb == args.microbatches - 1)
            optim.step()
            optim.zero_grad()
            dist.barrier()
            if step >= args.warmup:
                times[method].append(time.perf_counter() - t0)
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_step_args(p, vocab=8192, dim=64, batch=1, seq=256)
    p.add_argument("--head", default="grouped", choices=common.HEADS)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    args = p.parse_args()
    load_before = results.load()
    if not common.has_series_api():
        sys.exit("step_time.py needs the patched torch (method a)")
    methods = common.runnable(["a", "b", "d"], no_torchtitan=args.no_torchtitan)
    print(f"torch {torch.__version__}, FSDP world 2, {args.head} head, M={args.microbatches}, "
          f"N={args.num_chunks}, vocab {args.vocab}, dim {args.dim}, {args.layers} layers, "
          f"batch {args.batch}, seq {args.seq}; {args.steps} timed steps after {args.warmup} warm-up",
          flush=True)
    times = common.launch(run, 2, args, methods)
    if "error" in times:
        sys.exit(times["error"])
    params = common.step_params(args, "head", "warmup", "steps")
    results.write(args.json, "step_time", params, times, load_before, torch.__version__)
    print(render.step_time_table(times))


if __name__ == "__main__":
    main()
