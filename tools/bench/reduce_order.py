"""
When each reduce-scatter is issued relative to the decoder's backward (benchmark 1c).

The same chunked-loss step as :mod:`collectives` (M microbatches, N chunks,
gradients reduced on the last microbatch only), FSDP on 2 gloo ranks, with a
separate, grouped or tied head, for the methods of :mod:`common` this torch
supports. In the second optimizer step rank 0 records, in one sequence, every
reduce-scatter FSDP issues (the group whose ``post_backward`` issued it and its
buffer size) and, for every decoder block, when its backward compute starts
(the gradient of its output is ready: a tensor hook on the output) and ends
(the gradient of its input is ready: a tensor hook on the input, which fires
just before FSDP's post-backward of the block). From that sequence it derives:

* the position of the head group's reduce-scatter(s) among the reducing
  microbatch's reduce-scatters, and how many decoder blocks had started their
  backward when it was issued (0: before the decoder backward);
* whether the head's weight is unsharded (a plain tensor, not the sharded
  ``DTensor``: FSDP2's public view of it) when each decoder block's backward
  starts, in the reducing and in the other microbatches: an unsharded head
  holds its all-gathered weight through the decoder backward;
* "exposed" reduce-scatter bytes: those issued after the backward compute of
  the last decoder block (``layers.0``) finished, summed over the step's
  microbatches: on a GPU nothing of the decoder is left for them to hide
  behind; also those issued after it started.

``render.py`` turns the order into a table and, with the measured exposed
calls per group kind, computes the exposed bytes per step for Llama-3 8B and
70B. Run it in a pristine, a revision-2 and a patched venv::

    PRISTINE/bin/python tools/bench/reduce_order.py --json R/reduce-order-pristine.json
    REV2/bin/python     tools/bench/reduce_order.py --json R/reduce-order-rev2.json
    PATCHED/bin/python  tools/bench/reduce_order.py --methods a,b,d --json R/reduce-order-patched.json

The torch's applied series (its ``TORCH_PATCHES.json``; ``2.15.0`` when none)
is recorded as ``params["torch_series"]``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import render  # noqa: E402
import results  # noqa: E402
from counting import CallLog  # noqa: E402


def group_names(model: common.TinyLM, head: str):
    """``label_of(param_group)``: ``layers.i``, the head group's modules, or ``root``."""
    head_name = {"separate": "lm_head", "grouped": "[norm, lm_head]", "tied": "[tok_embeddings, lm_head]"}[head]

    def label_of(group) -> str:
        modules = getattr(group, "modules", ())
        if any(m is model.lm_head for m in modules):
            return head_name
        for i, layer in enumerate(model.layers):
            if any(m is layer for m in modules):
                return f"layers.{i}"
        return "root"

    return label_of


def _head_unsharded(model: common.TinyLM) -> bool:
    """Whether the head's registered weight is the unsharded tensor (FSDP2 registers the sharded
    ``DTensor`` while resharded)."""
    return not isinstance(model.lm_head.weight, DTensor)


def _record_block_backward(model: common.TinyLM, log: CallLog, marks: list, recording: list):
    """Tensor hooks that append ``(position in log.calls, "start"|"end", "layers.i")``; a "start"
    also records whether the head's weight is unsharded then."""
    handles = []
    for i, layer in enumerate(model.layers):
        name = f"layers.{i}"

        def pre(module, args, name=name):
            x = args[0]
            if recording[0] and isinstance(x, torch.Tensor) and x.requires_grad:
                x.register_hook(lambda g: marks.append((len(log.calls), "end", name)))

        def post(module, args, out, name=name):
            if recording[0] and out.requires_grad:
                out.register_hook(lambda g: marks.append((len(log.calls), "start", name, _head_unsharded(model))))

        # After fully_shard: FSDP's pre-forward has already wrapped the input for its post-backward
        handles += [layer.register_forward_pre_hook(pre), layer.register_forward_hook(post)]
    return handles


def _events(log: CallLog, marks: list, start: int, end: int, mark_from: int, mark_to: int) -> list[list]:
    """One microbatch's events in order: ``["RS", group, numel]`` and ``["start"|"end", block]``."""
    out: list[list] = []
    calls = [(i, c) for i, c in enumerate(log.calls) if start <= i < end and c[0] == "reduce_scatter"]
    ms = marks[mark_from:mark_to]
    ci = mi = 0
    while ci < len(calls) or mi < len(ms):
        # A mark taken when len(log.calls) == k precedes call k
        if mi < len(ms) and (ci == len(calls) or ms[mi][0] <= calls[ci][0]):
            out.append(list(ms[mi][1:]))
            mi += 1
        else:
            _, (kind, numel, nbytes, label) = calls[ci]
            out.append(["RS", label, numel, nbytes])
            ci += 1
    return out


def analyse(microbatches: list[dict], num_layers: int) -> dict:
    """Exposed reduce-scatters (after ``layers.0``'s backward started / finished) and the head's
    position in the reducing microbatch."""
    first = "layers.0"  # the last block the backward reaches
    exposed = {"after_start": {"calls": [], "bytes": 0}, "after_end": {"calls": [], "bytes": 0}}
    for mb in microbatches:
        started = ended = False
        for e in mb["events"]:
            if e[0] == "start" and e[1] == first:
                started = True
            elif e[0] == "end" and e[1] == first:
                ended = True
            elif e[0] == "RS":
                for key, on in (("after_start", started), ("after_end", ended)):
                    if on:
                        exposed[key]["calls"].append([e[1], e[2]])
                        exposed[key]["bytes"] += e[3]
    last = microbatches[-1]["events"]
    rs = [e for e in last if e[0] == "RS"]
    head_positions = []
    blocks_started = 0
    k = 0
    for e in last:
        if e[0] == "start":
            blocks_started += 1
        elif e[0] == "RS":
            k += 1
            if render.kind_of(e[1]) == "head":
                head_positions.append({"index": k, "blocks_started": blocks_started})
    # Decoder blocks whose backward started while the head's weight was unsharded
    head_unsharded = {"reducing": 0, "other": 0, "reducing_blocks": 0, "other_blocks": 0}
    for mb in microbatches:
        key = "reducing" if mb["reducing"] else "other"
        for e in mb["events"]:
            if e[0] == "start":
                head_unsharded[key + "_blocks"] += 1
                head_unsharded[key] += bool(e[2])
    return {"exposed": exposed, "head_positions": head_positions, "reduce_scatters_last_mb": len(rs),
            "num_layers": num_layers, "head_unsharded_in_decoder_bwd": head_unsharded}


def _run_method(rank, world_size, args, mesh, head, method):
    torch.manual_seed(0)
    model = common.TinyLM(vocab_size=args.vocab, dim=args.dim, num_layers=args.layers, tied=head == "tied")
    common.shard(model, head=head, mesh=mesh)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1000 + rank)
    tokens_per_step = args.batch * args.seq * args.microbatches
    step_fn = common.microbatch_fn(method, num_chunks=args.num_chunks, tokens_per_step=tokens_per_step)
    log, marks, recording = CallLog(), [], [False]
    handles = _record_block_backward(model, log, marks, recording)
    microbatches = []
    for step in range(2):
        for mb in range(args.microbatches):
            tokens = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)
            labels = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)
            last = mb == args.microbatches - 1
            kwargs = dict(num_chunks=args.num_chunks, scale=1.0 / tokens_per_step, last=last)
            if step == 1:
                recording[0] = True
                c0, m0 = len(log.calls), len(marks)
                with log.count(group_names(model, head)):
                    step_fn(model, tokens, labels, **kwargs)
                recording[0] = False
                microbatches.append({"reducing": last,
                                     "events": _events(log, marks, c0, len(log.calls), m0, len(marks))})
            else:
                step_fn(model, tokens, labels, **kwargs)
        optim.step()
        optim.zero_grad()
    for h in handles:
        h.remove()
    return {"config": "FSDP", "head": head, "method": method, "torch_series": results.torch_series(),
            "microbatches": microbatches, **analyse(microbatches, args.layers)}


def run_all(rank, world_size, args, methods):
    mesh = common.make_mesh("fsdp")
    out = []
    for head in common.HEADS:
        for method in methods:
            try:
                out.append(_run_method(rank, world_size, args, mesh, head, method))
            except Exception as e:  # report, keep going
                out.append({"config": "FSDP", "head": head, "method": method, "torch_series": results.torch_series(),
                            "error": f"{type(e).__name__}: {e}"})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_step_args(p, vocab=256, dim=32, batch=2, seq=32)
    p.set_defaults(layers=3)
    p.add_argument("--methods", default=None,
                   help="comma list of a,b,c,d (default: every one this torch/venv supports)")
    args = p.parse_args()
    load_before = results.load()
    methods = args.methods.split(",") if args.methods else (["a"] if common.has_series_api() else []) + ["b", "c", "d"]
    methods = common.runnable(methods, no_torchtitan=args.no_torchtitan)
    series = results.torch_series()
    print(f"torch {torch.__version__} ({series}), FSDP world 2, M={args.microbatches}, N={args.num_chunks}, "
          f"vocab {args.vocab}, dim {args.dim}, {args.layers} layers; methods {methods}", flush=True)
    rows = common.launch(run_all, 2, args, methods)
    if isinstance(rows, dict):
        raise SystemExit(f"failed\n{rows['error']}")
    params = {**common.step_params(args), "torch_series": series}
    results.write(args.json, "reduce_order", params, rows, load_before, torch.__version__)
    print(render.order_table(rows))


if __name__ == "__main__":
    main()
