"""
Runs every before/after snippet of docs/migration.md and measures them.

Each snippet is a ``python`` block of docs/migration.md whose first line is
``# before: ID`` (2.15.0 code reaching into FSDP's private state) or
``# after: ID`` (the public API of the patched torch). Both run here, on the
patched torch, CPU, gloo, 2 ranks (forked, one process group for everything),
on the model of ``tools/examples/chunked_loss.py`` in float64:

- a training snippet defines ``microbatch(model, tokens, labels, num_chunks)``
  (one microbatch, forward and backward; the harness runs 2 optimizer steps of
  2 microbatches, 4 chunks each) or ``step(model, batches, num_chunks)`` (a
  whole step). Measured per step: reduce-scatters, all-gathers, all-reduces,
  the largest difference of the parameters from a single-process float64
  full-logits reference, the head's gathered parameter bytes while the decoder
  backward runs, and whether every module's ``get_fsdp_policy()`` is what the
  caller had;
- a query snippet defines ``query(model)``; the harness asks it in fixed
  situations (after lazy init, mid-accumulation, after a step...) and records
  the answers, which must agree between before and after.

Usage (writes the JSON the doc's numbers come from; --render rewrites the
measured block of the doc from it)::

    python tools/examples/migration.py -o tools/bench/results/migration.json --render
"""

import argparse
import collections
import contextlib
import copy
import importlib.util
import json
import os
import re
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "migration.md"
STEPS, MICROBATCHES, CHUNKS, WORLD = 2, 2, 4, 2
BEGIN, END = "<!-- measured: begin -->", "<!-- measured: end -->"

#: Training programs: (id, layout, frozen decoder); the layout is how the head is sharded.
TRAIN = {
    "setters": ("grouped", False),
    "complete": ("grouped", False),
    "policy": ("grouped", False),
    "finish-trainable": ("grouped", False),
    "finish-frozen": ("grouped", True),
    "finish-full": ("grouped", False),
    "finish-loop": ("grouped", False),
}
#: Evaluation programs: three no_grad batches of ``evaluate(model, tokens, num_chunks)`` between training steps.
EVAL = ("eval", "finish-eval")
QUERIES = ("import", "pending", "root", "unsharded", "eval", "reset")


def snippets(text=None):
    """``{id: {"before": code, "after": code}}`` from the doc's python blocks."""
    text = DOC.read_text() if text is None else text
    out = collections.defaultdict(dict)
    for block in re.findall(r"```python\n(.*?)```", text, re.S):
        m = re.match(r"# (before|after|without|with): ([\w-]+)\n", block)
        if m:
            side = {"without": "before", "with": "after"}.get(m.group(1), m.group(1))
            assert side not in out[m.group(2)], f"two {m.group(0)!r} blocks"
            out[m.group(2)][side] = block
    return dict(out)


def _example():
    spec = importlib.util.spec_from_file_location("chunked_loss_example", REPO / "tools/examples/chunked_loss.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _diff(d):
    """Differences rendered stably: exact zero, below 1e-12, else two digits."""
    return "0" if d == 0 else "<1e-12" if d < 1e-12 else f"{d:.1e}"


def run(rank, store_path, out_path, programs=(), sides=("before", "after")):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    dist.init_process_group("gloo", store=dist.FileStore(store_path, WORLD), rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    ex = _example()
    blocks = snippets()
    mesh = init_device_mesh("cpu", (WORLD,))
    torch.manual_seed(0)
    base = ex.Transformer().double()

    def shard(model, layout):
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        if layout == "grouped":
            fully_shard([model.norm, model.lm_head], mesh=mesh)
        else:
            fully_shard(model.lm_head, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model

    def build(layout, frozen):
        model = copy.deepcopy(base)
        if frozen:  # only the head trains: the hidden states need no grad
            for module in (model.tok_embeddings, model.layers, model.norm):
                module.requires_grad_(False)
        reference = copy.deepcopy(model)
        return shard(model, layout), reference

    def batch(step, mb, r):
        gen = torch.Generator().manual_seed(1000 * step + 10 * mb + r)
        shape = (ex.BATCH_SIZE, ex.SEQ_LEN)
        return (torch.randint(0, ex.VOCAB_SIZE, shape, generator=gen),
                torch.randint(0, ex.VOCAB_SIZE, shape, generator=gen))

    def public_chunk_loop(model, tokens, labels, num_chunks):
        h = model(tokens)
        h_chunks = [c.detach().requires_grad_(h.requires_grad) for c in h.chunk(num_chunks, dim=1)]
        loss = torch.zeros((), dtype=torch.float64)
        with model.lm_head.partial_backward(outer_backward=h.requires_grad):
            for h_c, y_c in zip(h_chunks, labels.chunk(num_chunks, dim=1)):
                logits = model.lm_head.finish_forward(model.lm_head(h_c))
                chunk_loss = F.cross_entropy(logits.flatten(0, 1), y_c.flatten(), reduction="sum") / labels.numel()
                chunk_loss.backward()
                loss += chunk_loss.detach()
        if h.requires_grad:
            h.backward(torch.cat([c.grad for c in h_chunks], dim=1))
        return loss

    def namespace():
        return {"torch": torch, "F": F, "dist": dist, "FSDPModule": FSDPModule, "fully_shard": fully_shard,
                "chunk_loop": public_chunk_loop, "__name__": "migration_snippet"}

    @contextlib.contextmanager
    def sample_at_collectives(sample):
        """Call ``sample()`` before every all-gather, reduce-scatter and all-reduce."""
        names = ("all_gather_single", "reduce_scatter_single", "all_reduce", "all_gather_into_tensor",
                 "reduce_scatter_tensor")
        originals = {n: getattr(dist, n) for n in names if hasattr(dist, n)}

        def wrap(fn):
            def wrapper(*args, **kwargs):
                sample()
                return fn(*args, **kwargs)
            return wrapper
        try:
            for n, fn in originals.items():
                setattr(dist, n, wrap(fn))
            yield
        finally:
            for n, fn in originals.items():
                setattr(dist, n, fn)

    patched = hasattr(FSDPModule, "get_fsdp_policy")  # --programs on a pristine 2.15.0 measures less

    def policies(model):
        if not patched:
            return None
        return [m.get_fsdp_policy() for m in model.modules() if isinstance(m, FSDPModule)]

    def gathered_bytes(module):
        if not patched:
            return None
        return sum(p.numel() * p.element_size() for p in module.unsharded_parameters()
                   if p.untyped_storage().size() > 0)

    def train(code, layout, frozen):
        model, reference = build(layout, frozen)
        optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        ref_optim = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=1e-2)
        ns = namespace()
        exec(compile(code, "docs/migration.md", "exec"), ns)
        peak = [0]
        result = {"rs": [], "ag": [], "ar": [], "max_diff": [], "policy_kept": []}
        for step in range(STEPS):
            batches = [batch(step, mb, rank) for mb in range(MICROBATCHES)]
            before = policies(model)
            counts = collections.Counter()
            with ex.count_collectives(counts), sample_at_collectives(lambda: peak.__setitem__(
                    0, max(peak[0], gathered_bytes(model) or 0))):
                if "step" in ns:
                    ns["step"](model, batches, CHUNKS)
                else:
                    for tokens, labels in batches:
                        ns["microbatch"](model, tokens, labels, CHUNKS)
            result["policy_kept"].append(policies(model) == before if patched else None)
            for key in ("rs", "ag", "ar"):
                result[key].append(counts[key])
            optim.step()
            optim.zero_grad()
            loss = 0
            for mb in range(MICROBATCHES):  # the reference: every rank's data, full logits, float64
                for r in range(WORLD):
                    tokens, labels = batch(step, mb, r)
                    logits = reference.lm_head(reference(tokens))
                    loss = loss + F.cross_entropy(logits.flatten(0, 1), labels.flatten(),
                                                  reduction="sum") / labels.numel() / WORLD
            loss.backward()
            ref_optim.step()
            ref_optim.zero_grad()
            ours = [p.full_tensor() for p in model.parameters()]
            result["max_diff"].append(max((a - b).abs().max().item() for a, b in zip(ours, reference.parameters())))
        result["peak_gathered_bytes"] = peak[0] if patched else None
        result["max_diff"] = [_diff(d) for d in result["max_diff"]]
        return result

    def queries(code, which):
        """The answers of ``query(model)`` in the situations of ``which``."""
        ns = namespace()
        exec(compile(code, "docs/migration.md", "exec"), ns)
        query = ns.get("query")
        model, _ = build("grouped", False)
        tokens, labels = batch(0, 0, rank)
        if which == "reset":  # an exception in the middle of the chunk loop, then recovery and a retry
            clean, _ = build("grouped", False)
            public_chunk_loop(clean, tokens, labels, CHUNKS)
            public_chunk_loop(model, tokens, labels, CHUNKS)
            model.zero_grad(set_to_none=True)
            try:
                h = model(tokens)
                model.lm_head(h.detach()[:, :4])  # a partial group forward, then the loss fails
                raise ValueError("the loss failed")
            except ValueError:
                ns["recover"](model)
            counts = collections.Counter()
            with ex.count_collectives(counts):
                public_chunk_loop(model, tokens, labels, CHUNKS)
            diff = max((a.grad.to_local() - b.grad.to_local()).abs().max().item()
                       for a, b in zip(model.parameters(), clean.parameters()))
            return {"retry_vs_clean_grad_diff": _diff(diff), "retry_reduce_scatters": counts["rs"],
                    "retry_all_gathers": counts["ag"]}
        if which in EVAL:  # a training microbatch, three evaluation batches, then a training microbatch
            root = model._get_fsdp_state()  # the harness reads FSDP's bookkeeping; the snippets do not
            clean, _ = build("grouped", False)
            for m in (model, clean):
                public_chunk_loop(m, tokens, labels, CHUNKS)
                m.zero_grad(set_to_none=True)
            order = []
            for _ in range(3):
                ns["evaluate"](model, tokens, CHUNKS)
                order.append(len(root._comm_ctx.post_forward_order))
            answers = {"post_forward_order_after_each_eval": order,
                       "gathered_bytes_after_eval": gathered_bytes(model)}
            counts = collections.Counter()
            with ex.count_collectives(counts):
                public_chunk_loop(model, tokens, labels, CHUNKS)
            public_chunk_loop(clean, tokens, labels, CHUNKS)
            answers["next_microbatch_all_gathers"] = counts["ag"]
            answers["next_microbatch_reduce_scatters"] = counts["rs"]
            answers["next_microbatch_grad_diff_vs_no_eval"] = _diff(max(
                (a.grad.to_local() - b.grad.to_local()).abs().max().item()
                for a, b in zip(model.parameters(), clean.parameters())))
            return answers
        answers = {"fresh": query(model)}
        h = model(tokens)
        answers["after_forward"] = query(model)
        h.sum().backward()
        model.zero_grad(set_to_none=True)
        with model.fsdp_policy(requires_gradient_sync=False, recurse=True):
            public_chunk_loop(model, tokens, labels, CHUNKS)
        answers["no_sync_microbatch"] = query(model)
        public_chunk_loop(model, tokens, labels, CHUNKS)
        answers["reducing_microbatch"] = query(model)
        return answers

    results = {"train": {}, "query": {}}
    for name, pair in sorted(blocks.items()):
        if programs and name not in programs:
            continue
        for side in ("before", "after"):
            if side not in pair or side not in sides:
                continue
            if name in TRAIN:
                results["train"].setdefault(name, {})[side] = train(pair[side], *TRAIN[name])
            else:
                results["query"].setdefault(name, {})[side] = queries(pair[side], name)
            dist.barrier()
    if rank == 0:
        results["setup"] = {"programs": sorted(programs) or "all", "sides": list(sides), "world_size": WORLD, "steps": STEPS, "microbatches": MICROBATCHES, "chunks": CHUNKS,
                            "dtype": "float64", "model": "tools/examples/chunked_loss.py Transformer",
                            "torch": torch.__version__}
        Path(out_path).write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    dist.destroy_process_group()


def render(results):
    """The doc's measured block, from a result file."""
    s = results["setup"]
    lines = [BEGIN, "",
             f"Per optimizer step ({s['microbatches']} microbatches of {s['chunks']} chunks, {s['world_size']} "
             f"gloo ranks, float64; `max diff`: largest parameter difference from a single-process full-logits "
             f"reference after each step; `peak bytes`: the most parameter bytes gathered on a rank when a "
             f"collective starts; `policy kept`: every module's `get_fsdp_policy()` after the step equals the "
             f"caller's):", "",
             "| program | code | reduce-scatters | all-gathers | max diff | peak bytes | policy kept |",
             "|---|---|---|---|---|---|---|"]
    for name, pair in sorted(results["train"].items()):
        for side in ("before", "after"):
            if side in pair:
                r = pair[side]
                lines.append(f"| `{name}` | {side} | {' / '.join(map(str, r['rs']))} | "
                             f"{' / '.join(map(str, r['ag']))} | {' / '.join(r['max_diff'])} | "
                             f"{r['peak_gathered_bytes']} | "
                             f"{'yes' if all(r['policy_kept']) else 'no'} |")
    lines += ["", "Queries and recovery: the answers in each situation (equal answers are shown once):", "",
              "| program | code | situation: answer |", "|---|---|---|"]
    for name, pair in sorted(results["query"].items()):
        sides = ["before", "after"] if pair.get("before") != pair.get("after") else ["after"]
        for side in sides:
            answers = pair[side]
            lines.append(f"| `{name}` | {side if len(sides) == 2 else 'before = after'} | "
                         + "; ".join(f"{k}: {json.dumps(v)}" for k, v in answers.items()) + " |")
    return "\n".join(lines + ["", END])


def render_into_doc(results, doc=DOC):
    text = doc.read_text()
    head, rest = text.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    doc.write_text(head + render(results) + tail)


def main():
    import torch.multiprocessing as mp
    parser = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0])
    parser.add_argument("-o", "--output", default="migration.json", help="result file (JSON)")
    parser.add_argument("--render", action="store_true", help="rewrite docs/migration.md's measured block from it")
    parser.add_argument("--programs", default="", help="comma-separated snippet ids (default: all)")
    parser.add_argument("--before-only", action="store_true",
                        help="run only the before snippets (on a pristine 2.15.0: --programs setters,complete)")
    args = parser.parse_args()
    programs = tuple(p for p in args.programs.split(",") if p)
    sides = ("before",) if args.before_only else ("before", "after")
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(run, args=(os.path.join(tmp, "store"), os.path.abspath(args.output), programs, sides),
                           nprocs=WORLD, start_method="fork")
    results = json.loads(Path(args.output).read_text())
    if args.render:
        assert not programs and not args.before_only, "--render needs a run of every snippet"
        render_into_doc(results)
    print(f"wrote {args.output}" + (f" and the measured block of {DOC.relative_to(REPO)}" if args.render else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
