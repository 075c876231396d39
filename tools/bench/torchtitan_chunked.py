"""
torchtitan 0.3.0's ``ChunkedLossWrapper`` next to the consumer series' patched
one, in the same run: collectives per optimizer step, where the head's
reduce-scatter falls among the step's reduce-scatters, whether the caller's
FSDP policy survives the step, the gradient error against a full-logits
reference, and the step time ratio.

Needs the patched torch and the installed torchtitan 0.3.0 with the consumer
series applied (``python -m torch_patches torchtitan apply``): the released
wrapper is loaded from the pristine bytes the consumer marker keeps, the
patched one is ``torchtitan.components.loss``. FSDP on gloo/CPU, forked ranks::

    python tools/bench/torchtitan_chunked.py [--world-size 2] [--steps 20] [--out FILE]

Prints one line per scenario and wrapper and writes a JSON result file
(default ``tools/bench/results/torchtitan-chunked.json``), which
``python -m torch_patches torchtitan export --results FILE`` renders into PR.md.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parent))
import results  # noqa: E402

from torch_patches import consumers  # noqa: E402

VOCAB, DIM, SEQ, LAYERS = 512, 64, 64, 2
MICROBATCH, MICROBATCHES, CHUNKS = 2, 2, 4
LOSS_PY = "torchtitan/components/loss.py"


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, x):
        return x + torch.tanh(self.lin(x))


class Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList([Block() for _ in range(LAYERS)])
        self.norm = nn.LayerNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
        # Makes the root group's size differ from the head's (to tell their reductions apart)
        self.pos = nn.Parameter(torch.randn(SEQ, DIM) * 0.02)
        self.skip_lm_head = False

    def forward(self, tokens):
        h = self.tok_embeddings(tokens) + self.pos
        for layer in self.layers:
            h = layer(h)
        h = self.norm(h)
        return h if self.skip_lm_head else self.lm_head(h)


def released_loss_module():
    """torchtitan 0.3.0's loss module, from the consumer marker's pristine bytes."""
    spec = importlib.util.find_spec("torchtitan")
    root = Path(list(spec.submodule_search_locations)[0]).parent
    (dist_info,) = root.glob("torchtitan-*.dist-info")
    marker = json.loads((dist_info / "TORCH_PATCHES_CONSUMER.json").read_text())
    source = marker["files"][LOSS_PY]["pristine"]
    module = type(sys)("torchtitan_released_loss")
    module.__file__ = f"<torchtitan 0.3.0 {LOSS_PY}>"
    sys.modules[module.__name__] = module  # dataclasses look the module up
    exec(compile(source, module.__file__, "exec"), module.__dict__)
    return module


def run_rank(rank, world_size, store_path, args, queue):
    dist.init_process_group(
        "gloo", store=dist.FileStore(store_path, world_size), rank=rank, world_size=world_size
    )
    torch.set_num_threads(1)
    import torchtitan.components.loss as patched

    wrappers = {"0.3.0": released_loss_module().ChunkedLossWrapper,
                "patched": patched.ChunkedLossWrapper}
    mesh = init_device_mesh("cpu", (world_size,))
    rows = []
    for head in ("separate", "grouped"):
        for name, cls in wrappers.items():
            torch.manual_seed(0)
            ref = Decoder()
            model = copy.deepcopy(ref)
            model.skip_lm_head = True
            for layer in model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model.lm_head if head == "separate" else [model.norm, model.lm_head], mesh=mesh)
            fully_shard(model, mesh=mesh)
            # A head reduction covers lm_head, or lm_head and norm when grouped
            head_numels = {VOCAB * DIM, VOCAB * DIM + 2 * DIM} if head == "grouped" else {VOCAB * DIM}
            wrapper = cls(cls.Config(num_chunks=CHUNKS))
            wrapper.set_lm_head(model.lm_head)
            calls = []
            originals = {n: getattr(dist, n) for n in ("reduce_scatter_single", "all_gather_single")}

            def wrap(n):
                def f(*a, **k):
                    t = k.get("input", a[1] if len(a) > 1 else None)
                    calls.append((n, t.numel() if n == "reduce_scatter_single" and t is not None else 0))
                    return originals[n](*a, **k)
                return f

            policy_before = [m.get_fsdp_policy() for m in model.modules() if isinstance(m, FSDPModule)]
            counts, head_positions, times, error = [], [], [], ""
            per_microbatch, policy_kept_in_scope = [], True
            try:
                for step in range(args.steps):
                    gen = torch.Generator().manual_seed(step)
                    tokens = torch.randint(0, VOCAB, (world_size * MICROBATCH * MICROBATCHES, SEQ), generator=gen)
                    labels = torch.randint(0, VOCAB, tokens.shape, generator=gen)
                    n = MICROBATCH * MICROBATCHES
                    mine = slice(rank * n, (rank + 1) * n)
                    calls.clear()
                    for k, v in originals.items():
                        setattr(dist, k, wrap(k))
                    start = time.perf_counter()
                    try:
                        for mb in range(MICROBATCHES):
                            last = mb == MICROBATCHES - 1
                            s = slice(mb * MICROBATCH, (mb + 1) * MICROBATCH)
                            before = len(calls)
                            with model.fsdp_policy(requires_gradient_sync=last, is_last_backward=last,
                                                   recurse=True) as applied:
                                loss, _ = wrapper(model(tokens[mine][s]), labels[mine][s], torch.tensor(n * SEQ))
                                loss.backward()
                                # The caller's policy for this microbatch, after the loss call
                                policy_kept_in_scope &= model.lm_head.get_fsdp_policy() == applied
                            per_microbatch.append(sum(c == "reduce_scatter_single" for c, _ in calls[before:]))
                    finally:
                        for k, v in originals.items():
                            setattr(dist, k, v)
                    times.append(time.perf_counter() - start)
                    rs = [numel for c, numel in calls if c == "reduce_scatter_single"]
                    counts.append((len(rs), sum(c == "all_gather_single" for c, _ in calls)))
                    head_positions.append([i for i, numel in enumerate(rs) if numel in head_numels])
                    ref_loss = F.cross_entropy(ref(tokens).flatten(0, 1), labels.flatten())
                    ref_loss.backward()
                    diff = max((p.grad.full_tensor() - q.grad).abs().max().item()
                               for p, q in zip(model.parameters(), ref.parameters()))
                    for m in (model, ref):
                        for p in m.parameters():
                            p.grad = None
            except Exception as exc:  # recorded, not raised: the released wrapper may fail a scenario
                error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
                diff = float("nan")
            policy_after = [m.get_fsdp_policy() for m in model.modules() if isinstance(m, FSDPModule)]
            rows.append({
                "scenario": f"FSDP{world_size}, {head} head, {MICROBATCHES} microbatches (sync on last)",
                "wrapper": name,
                "reduce_scatter": counts[-1][0] if counts else None,
                "all_gather": counts[-1][1] if counts else None,
                "head_reduce_scatter_positions": head_positions[-1] if head_positions else None,
                "policy_kept": policy_after == policy_before and policy_kept_in_scope,
                "reduce_scatter_per_microbatch": per_microbatch[-MICROBATCHES:],
                "max_grad_diff": diff,
                "step_time_s": sorted(times)[len(times) // 2] if times else None,
                "error": error,
            })
    if rank == 0:
        queue.put(rows)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps per run (default 20; "
                        "counts are the last step's, step times the median)")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "torchtitan-chunked.json"))
    args = parser.parse_args()
    load_before = results.load()
    ctx = mp.get_context("fork")
    queue = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(run_rank, args=(args.world_size, os.path.join(tmp, "store"), args, queue),
                           nprocs=args.world_size, start_method="fork")
        rows = queue.get()
    by = {(r["scenario"], r["wrapper"]): r for r in rows}
    for r in rows:
        base = by.get((r["scenario"], "0.3.0"))
        ratio = (r["step_time_s"] / base["step_time_s"]) if base and base["step_time_s"] and r["step_time_s"] else None
        r["step_time_ratio_vs_0.3.0"] = ratio
        print(f"{r['scenario']} | {r['wrapper']:8} | RS/step {r['reduce_scatter']} AG/step {r['all_gather']} | "
              f"per microbatch {r['reduce_scatter_per_microbatch']} | "
              f"head RS at {r['head_reduce_scatter_positions']} | "
              f"policy {'kept' if r['policy_kept'] else 'overwritten'}"
              f" | max |grad - ref| {r['max_grad_diff']:.2e} | step {r['step_time_s'] or float('nan'):.4f} s"
              f" (x{ratio or float('nan'):.2f}) {r['error']}", flush=True)
    command = "python tools/bench/torchtitan_chunked.py" + "".join(
        f" --{k.replace('_', '-')} {v}" for k, v in (("world_size", args.world_size), ("steps", args.steps))
        if v != parser.get_default(k))
    result = {
        "benchmark": "torchtitan_chunked",
        "meta": results.meta(load_before, torch.__version__),
        "params": {"command": command, "world_size": args.world_size, "steps": args.steps,
                   "torch_series": results.torch_series(),
                   "consumer_series_revision": consumers.load_consumer_series().revision},
        "note": ("Counts are the last step's (steady state). Step times are medians over the steps, "
                 "on a shared 2-core CPU machine with gloo: only the ratio is meaningful."),
        "rows": rows,
    }
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
