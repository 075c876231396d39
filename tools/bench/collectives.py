"""
Collectives per optimizer step of a chunked-loss step (benchmark 1).

M microbatches per optimizer step, N loss chunks per microbatch, a tiny LM
with a separate (``fully_shard(lm_head)``), grouped
(``fully_shard([norm, lm_head])``) or tied (``fully_shard([tok_embeddings,
lm_head])`` sharing one weight) head, on FSDP (world 2) and HSDP 2x2 (world
4), gloo on CPU. Counts the reduce-scatters, all-gathers and all-reduces FSDP
issues in one optimizer step (the second; the first does lazy init) and the
bytes they move on rank 0, for the methods of :mod:`common` that this torch
supports (``a`` needs the patched torch, ``b`` needs torchtitan).

The minimum is one reduction per FSDP group with trainable parameters per
step: one reduce-scatter per group, plus (HSDP) one all-reduce per group.
"ratio" is (reduce-scatters + all-reduces) / that minimum.

Run it once in a pristine and once in a patched venv; the second run, given
``--compare`` with the first's JSON and dump directory, prints the combined
table and the max abs difference of method ``b``'s losses and gradients
between the two torches::

    PRISTINE/bin/python tools/bench/collectives.py --json /tmp/p.json --dump /tmp/p
    PATCHED/bin/python  tools/bench/collectives.py --compare /tmp/p.json --compare-dump /tmp/p
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
CONFIGS = {"FSDP": ("fsdp", 2), "HSDP 2x2": ("hsdp", 4)}


def run_config(rank, world_size, kind, args, methods, dump_dir, label):
    torch_label = "patched" if common.has_series_api() else "2.15.0"
    mesh = common.make_mesh(kind)
    results = []
    for head in common.HEADS:
        for method in methods:
            torch.manual_seed(0)
            model = common.TinyLM(vocab_size=args.vocab, dim=args.dim, num_layers=args.layers,
                                  tied=head == "tied")
            try:
                num_groups = common.shard(model, head=head, mesh=mesh)
                optim = torch.optim.SGD(model.parameters(), lr=0.1)
                gen = torch.Generator().manual_seed(1000 + rank)
                tokens_per_step = args.batch * args.seq * args.microbatches
                step_fn = common.microbatch_fn(method, num_chunks=args.num_chunks,
                                               tokens_per_step=tokens_per_step)
                losses = []
                counter = common.CollectiveCounter()
                for step in range(2):
                    loss = torch.zeros(())
                    for mb in range(args.microbatches):
                        tokens = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)
                        labels = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)
                        last = mb == args.microbatches - 1
                        if step == 1:
                            with counter.count():
                                loss += step_fn(model, tokens, labels, num_chunks=args.num_chunks,
                                                scale=1.0 / tokens_per_step, last=last)
                        else:
                            loss += step_fn(model, tokens, labels, num_chunks=args.num_chunks,
                                            scale=1.0 / tokens_per_step, last=last)
                    losses.append(loss.item())
                    if step == 1 and dump_dir and method == "b":
                        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
                        all_losses = [None] * world_size
                        dist.all_gather_object(all_losses, losses)
                        if rank == 0:
                            Path(dump_dir).mkdir(parents=True, exist_ok=True)
                            torch.save({"losses": all_losses, "grads": grads},
                                       Path(dump_dir, f"{label}-{head}-{method}.pt"))
                    optim.step()
                    optim.zero_grad()
                red_min = num_groups * (2 if kind == "hsdp" else 1)
                results.append({
                    "config": label, "head": head, "method": method, "torch": torch_label,
                    "counts": dict(counter.counts), "bytes": dict(counter.bytes),
                    "losses": losses, "min_reductions": red_min, "groups": num_groups,
                })
            except Exception as e:  # report, keep going (e.g. an unsupported combination)
                results.append({"config": label, "head": head, "method": method,
                                "torch": torch_label, "error": f"{type(e).__name__}: {e}"})
    return results


def fmt_bytes(n: int) -> str:
    return f"{n / 1024:.1f} KiB"


def print_table(results, pp_rows):
    headers = ["config", "head", "method", "torch", "reduce-scatter", "all-gather", "all-reduce",
               "bytes RS/AG/AR (rank 0)", "min reductions", "ratio"]
    rows = []
    for r in results:
        if "error" in r:
            rows.append([r["config"], r["head"], r["method"], r["torch"], "error: " + r["error"][:70],
                         "", "", "", "", ""])
            continue
        c, b = r["counts"], r["bytes"]
        red = c.get("reduce_scatter", 0) + c.get("all_reduce", 0)
        rows.append([r["config"], r["head"], f"{r['method']} {common.METHOD_NAMES[r['method']]}",
                     r["torch"], c.get("reduce_scatter", 0), c.get("all_gather", 0),
                     c.get("all_reduce", 0),
                     "/".join(fmt_bytes(b.get(k, 0)) for k in ("reduce_scatter", "all_gather", "all_reduce")),
                     r["min_reductions"], f"{red / r['min_reductions']:.2f}"])
    rows.extend(pp_rows)
    print(common.table(headers, rows), flush=True)


def compare_dumps(mine: Path, theirs: Path) -> list[list]:
    rows = []
    for path in sorted(theirs.glob("*.pt")):
        other = mine / path.name
        if not other.exists():
            rows.append([path.stem, "missing in this run", ""])
            continue
        a, b = torch.load(path), torch.load(other)
        loss_diff = max(abs(x - y) for la, lb in zip(a["losses"], b["losses"]) for x, y in zip(la, lb))
        grad_diff = max((a["grads"][n] - b["grads"][n]).abs().max().item() for n in a["grads"])
        rows.append([path.stem, f"{loss_diff:.3g}", f"{grad_diff:.3g}"])
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--microbatches", type=int, default=3)
    p.add_argument("--num-chunks", type=int, default=4)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--methods", default=None,
                   help="comma list of a,b,c,d (default: every one this torch/venv supports)")
    p.add_argument("--configs", default="FSDP,HSDP 2x2")
    p.add_argument("--no-torchtitan", action="store_true", help="skip method b")
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--dump", type=Path, help="write method b's losses and gradients here")
    p.add_argument("--compare", type=Path, help="JSON of a run on the other torch, merged into the table")
    p.add_argument("--compare-dump", type=Path, help="--dump directory of that run")
    args = p.parse_args()

    if args.methods:
        methods = args.methods.split(",")
    else:
        methods = (["a"] if common.has_series_api() else []) + ["b", "c", "d"]
    if args.no_torchtitan and "b" in methods:
        methods.remove("b")
    if "b" in methods:
        try:
            import torchtitan.components.loss  # noqa: F401
        except Exception as e:
            print(f"torchtitan not importable ({type(e).__name__}: {e}); skipping method b")
            methods.remove("b")
    if args.compare_dump and not args.dump and "b" in methods:
        args.dump = Path(args.compare_dump).with_name(args.compare_dump.name + "-patched")

    print(f"torch {torch.__version__} ({'patched' if common.has_series_api() else 'unpatched'}), "
          f"M={args.microbatches} microbatches, N={args.num_chunks} chunks, vocab {args.vocab}, "
          f"dim {args.dim}, {args.layers} layers, batch {args.batch}, seq {args.seq}; methods {methods}",
          flush=True)
    results = []
    for label in args.configs.split(","):
        kind, world = CONFIGS[label]
        out = common.launch(run_config, world, kind, args, methods,
                            str(args.dump) if args.dump else None, label)
        if isinstance(out, dict):
            print(f"{label}: failed\n{out['error']}", flush=True)
            continue
        results.extend(out)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    pp_rows = []
    if not common.pipelining_patch_in_series(REPO):
        pp_rows = [["PP2xFSDP2", "-", sched, "-", "PP: pending patch", "", "", "", "", ""]
                   for sched in ("GPipe", "1F1B", "Interleaved1F1B")]
    else:
        pp_rows = [["PP2xFSDP2", "-", "-", "-", "PP: see tools/bench/pp_collectives.py",
                    "", "", "", "", ""]]
    merged = results
    if args.compare:
        other = json.loads(args.compare.read_text())
        merged = sorted(results + other, key=lambda r: (list(CONFIGS).index(r["config"]),
                                                          common.HEADS.index(r["head"]), r["method"],
                                                          r["torch"]))
    print_table(merged, pp_rows)
    if args.compare_dump and args.dump:
        print("\nmethod b (torchtitan ChunkedLossWrapper), patched vs unpatched 2.15.0, "
              "max abs difference (losses of both steps, all ranks; full gradients of step 2):")
        print(common.table(["config-head-method", "losses", "gradients"],
                           compare_dumps(args.dump, args.compare_dump)))


if __name__ == "__main__":
    main()
