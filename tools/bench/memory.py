"""
Peak memory of a chunked-loss step vs the full-logits step (benchmark 3), as
the vocabulary and the sequence length grow.

Measured with the PyTorch profiler's memory accounting
(``torch.profiler.profile(profile_memory=True)``): every CPU allocation and
free the CPU allocator reports is an allocation record with its signed size;
the peak is the maximum of their running sum over one training step (forward,
backward, optimizer step), i.e. the peak of tensor memory allocated during the
step above what was live when it started (parameters and their sharded state
are live before the step; the first step does lazy init and is not measured).
One rank (FSDP over a world of 1, gloo), batch 1, small hidden size; the
chunked step is the series' API (method ``a``) with ``--num-chunks`` chunks,
the full step computes ``[1, seq, vocab]`` logits at once (method ``d``).
The analytic size beside it is the fp32 logits, seq * vocab * 4 bytes, plus
their gradient (x2); for the chunked step, one chunk's share of that.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import render  # noqa: E402
import results  # noqa: E402



def _walk(nodes):
    for node in nodes:
        yield node
        yield from _walk(node.children)


def peak_bytes(prof) -> int:
    """Peak of the running sum of the profiler's allocation records (signed sizes, in time order)."""
    from torch._C._profiler import _EventType

    records = sorted((n.start_time_ns, n.extra_fields.alloc_size)
                     for n in _walk(prof.profiler.kineto_results.experimental_event_tree())
                     if n.tag == _EventType.Allocation)
    live = peak = 0
    for _, delta in records:
        live += delta
        peak = max(peak, live)
    return peak


def run(rank, world_size, args, points):
    mesh = common.make_mesh("fsdp")
    out = []
    for vocab, seq in points:
        row = {"vocab": vocab, "seq": seq}
        for method in ("a", "d"):
            torch.manual_seed(0)
            model = common.TinyLM(vocab_size=vocab, dim=args.dim, num_layers=1)
            common.shard(model, head="grouped", mesh=mesh)
            optim = torch.optim.SGD(model.parameters(), lr=0.01)
            fn = common.microbatch_fn(method, num_chunks=args.num_chunks, tokens_per_step=seq)
            tokens = torch.randint(0, vocab, (1, seq))
            labels = torch.randint(0, vocab, (1, seq))
            for step in range(2):
                if step == 1:
                    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                        fn(model, tokens, labels, num_chunks=args.num_chunks, scale=1.0 / seq, last=True)
                        optim.step()
                        optim.zero_grad()
                    row[method] = peak_bytes(prof)
                else:
                    fn(model, tokens, labels, num_chunks=args.num_chunks, scale=1.0 / seq, last=True)
                    optim.step()
                    optim.zero_grad()
            del model, optim
        out.append(row)
    return out


def parse_points(spec: str) -> list[tuple[int, int]]:
    return [tuple(int(x) for x in p.split("x")) for p in spec.split(",")]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--num-chunks", type=int, default=8)
    p.add_argument("--vocab-sweep", default="32768x2048,65536x2048,131072x2048",
                   help="VOCABxSEQ points of the vocabulary sweep")
    p.add_argument("--seq-sweep", default="65536x1024,65536x2048,65536x4096",
                   help="VOCABxSEQ points of the sequence sweep")
    p.add_argument("--json", type=Path, help="write the results here (render.py draws the plot from it)")
    args = p.parse_args()
    load_before = results.load()
    if not common.has_series_api():
        sys.exit("memory.py needs the patched torch (method a)")
    vocab_pts, seq_pts = parse_points(args.vocab_sweep), parse_points(args.seq_sweep)
    points = list(dict.fromkeys(vocab_pts + seq_pts))
    print(f"torch {torch.__version__}, 1 rank, batch 1, dim {args.dim}, N={args.num_chunks} chunks; "
          "peak = max running sum of the profiler's allocation records during step 2", flush=True)
    rows = common.launch(run, 1, args, points)
    if isinstance(rows, dict):
        sys.exit(rows["error"])
    params = {"dim": args.dim, "num_chunks": args.num_chunks, "vocab_sweep": vocab_pts, "seq_sweep": seq_pts}
    results.write(args.json, "memory", params, rows, load_before, torch.__version__)
    print(render.memory_table(rows, args.num_chunks))


if __name__ == "__main__":
    main()
