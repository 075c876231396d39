"""
Collectives per optimizer step of a chunked-loss step (benchmark 1).

M microbatches per optimizer step, N loss chunks per microbatch, a tiny LM
with a separate (``fully_shard(lm_head)``), grouped
(``fully_shard([norm, lm_head])``) or tied (``fully_shard([tok_embeddings,
lm_head])`` sharing one weight) head, on FSDP (world 2) and HSDP 2x2 (world
4), gloo on CPU. Counts the reduce-scatters, all-gathers and all-reduces FSDP
issues in one optimizer step (the second; the first does lazy init), the bytes
they move on rank 0, and, per FSDP group kind (a decoder layer, the head
group, the root), the reduce-scatters and all-gathers (attributed by buffer
size; ``render.py`` turns those into the "scale on paper" table), for the
methods of :mod:`common` that this torch supports (``a`` needs the patched
torch, ``b`` needs torchtitan).

The minimum is one reduction per FSDP group with trainable parameters per
step: one reduce-scatter per group, plus (HSDP) one all-reduce per group.

Run it once in a pristine and once in a patched venv; ``--dump`` keeps method
``b``'s losses and gradients, and ``--compare-dump`` (with ``--parity-json``)
writes their max abs difference between the two torches::

    PRISTINE/bin/python tools/bench/collectives.py --json R/collectives-pristine.json --dump /tmp/p
    PATCHED/bin/python  tools/bench/collectives.py --json R/collectives-patched.json \\
        --compare-dump /tmp/p --parity-json R/parity.json
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import render  # noqa: E402
import results  # noqa: E402
from counting import CallLog  # noqa: E402

CONFIGS = {"FSDP": ("fsdp", 2), "HSDP 2x2": ("hsdp", 4)}


def _run_method(rank, world_size, kind, args, mesh, head, method, dump_dir, label):
    torch.manual_seed(0)
    model = common.TinyLM(vocab_size=args.vocab, dim=args.dim, num_layers=args.layers, tied=head == "tied")
    num_groups = common.shard(model, head=head, mesh=mesh)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1000 + rank)
    tokens_per_step = args.batch * args.seq * args.microbatches
    step_fn = common.microbatch_fn(method, num_chunks=args.num_chunks, tokens_per_step=tokens_per_step)
    losses, log = [], CallLog()
    for step in range(2):
        loss = torch.zeros(())
        for mb in range(args.microbatches):
            tokens = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)
            labels = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)
            kwargs = dict(num_chunks=args.num_chunks, scale=1.0 / tokens_per_step,
                          last=mb == args.microbatches - 1)
            if step == 1:
                with log.count(common.group_label(model)):
                    loss += step_fn(model, tokens, labels, **kwargs)
            else:
                loss += step_fn(model, tokens, labels, **kwargs)
        losses.append(loss.item())
        if step == 1 and dump_dir and method == "b":
            grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
            all_losses = [None] * world_size
            dist.all_gather_object(all_losses, losses)
            if rank == 0:
                Path(dump_dir).mkdir(parents=True, exist_ok=True)
                torch.save({"losses": all_losses, "grads": grads}, Path(dump_dir, f"{label}-{head}-{method}.pt"))
        optim.step()
        optim.zero_grad()
    return {
        "config": label, "head": head, "method": method,
        "torch": "patched" if common.has_series_api() else "unpatched",
        "counts": dict(log.counts), "bytes": dict(log.bytes), "losses": losses,
        "min_reductions": num_groups * (2 if kind == "hsdp" else 1), "groups": num_groups,
        "per_group_sizes": {k: log.sizes_by_group(k) for k in ("reduce_scatter", "all_gather")},
        "num_layers": args.layers,
    }


def run_config(rank, world_size, kind, args, methods, dump_dir, label):
    mesh = common.make_mesh(kind)
    out = []
    for head in common.HEADS:
        for method in methods:
            try:
                out.append(_run_method(rank, world_size, kind, args, mesh, head, method, dump_dir, label))
            except Exception as e:  # report, keep going (e.g. an unsupported combination)
                out.append({"config": label, "head": head, "method": method,
                            "torch": "patched" if common.has_series_api() else "unpatched",
                            "error": f"{type(e).__name__}: {e}"})
    return out


def compare_dumps(mine: Path, theirs: Path) -> list[dict]:
    """Max abs difference of method b's losses (both steps, all ranks) and step-2 gradients."""
    rows = []
    for path in sorted(theirs.glob("*.pt")):
        other = mine / path.name
        if not other.exists():
            rows.append({"run": path.stem, "missing": True})
            continue
        a, b = torch.load(path), torch.load(other)
        loss_diff = max(abs(x - y) for la, lb in zip(a["losses"], b["losses"]) for x, y in zip(la, lb))
        grad_diff = max((a["grads"][n] - b["grads"][n]).abs().max().item() for n in a["grads"])
        rows.append({"run": path.stem, "losses": loss_diff, "gradients": grad_diff})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_step_args(p, vocab=256, dim=32, batch=2, seq=32)
    p.add_argument("--methods", default=None,
                   help="comma list of a,b,c,d (default: every one this torch/venv supports)")
    p.add_argument("--configs", default="FSDP,HSDP 2x2")
    p.add_argument("--dump", type=Path, help="write method b's losses and gradients here")
    p.add_argument("--compare-dump", type=Path, help="--dump directory of a run on the other torch")
    p.add_argument("--parity-json", type=Path, help="with --compare-dump: write method b's differences here")
    args = p.parse_args()
    load_before = results.load()

    methods = args.methods.split(",") if args.methods else (["a"] if common.has_series_api() else []) + ["b", "c", "d"]
    methods = common.runnable(methods, no_torchtitan=args.no_torchtitan)
    print(f"torch {torch.__version__} ({'patched' if common.has_series_api() else 'unpatched'}), "
          f"M={args.microbatches} microbatches, N={args.num_chunks} chunks, vocab {args.vocab}, "
          f"dim {args.dim}, {args.layers} layers, batch {args.batch}, seq {args.seq}; methods {methods}",
          flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        dump = args.dump or (Path(tmp) if args.compare_dump and "b" in methods else None)
        rows = []
        for label in args.configs.split(","):
            kind, world = CONFIGS[label]
            out = common.launch(run_config, world, kind, args, methods, str(dump) if dump else None, label)
            if isinstance(out, dict):
                print(f"{label}: failed\n{out['error']}", flush=True)
                continue
            rows.extend(out)
        parity = compare_dumps(dump, args.compare_dump) if args.compare_dump and dump else None
    params = common.step_params(args)
    results.write(args.json, "collectives", params, rows, load_before, torch.__version__)
    print(render.collectives_table(rows))
    if parity is not None:
        results.write(args.parity_json, "parity", params, parity, load_before, torch.__version__)
        print(render.parity_table(parity))


if __name__ == "__main__":
    main()
