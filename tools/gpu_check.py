"""
Validates the series on a CUDA machine in one command (issue 28): CUDA streams
under the sanitizer, memory at scale, reduce-scatter overlap, step time.

    python tools/gpu_check.py [--out FILE] [--steps 5]   # CUDA + NCCL, one rank per GPU
    python tools/gpu_check.py --cpu [--world-size 4]     # the same code paths at tiny sizes (CI)

Without CUDA (and without ``--cpu``) it says so in one line and exits 2. It
installs nothing: it needs the patched torch, and for the two torchtitan rows
torchtitan 0.3.0 with the consumer series applied (``python -m torch_patches
torchtitan apply``; the released wrapper is loaded from the pristine bytes the
consumer marker keeps, as ``tools/bench/torchtitan_chunked.py`` does). Four
parts, each in its own processes, with progress lines:

1. **correctness**: one NCCL rank per GPU (gloo ranks with ``--cpu``), under
   ``TORCH_CUDA_SANITIZER=1`` (CSAN raises on an unsynchronized access across
   CUDA streams). The series' chunked-loss step (method ``a`` of
   ``tools/bench/common.py``: ``fsdp_policy`` deferral over 2 microbatches,
   ``lm_head.partial_backward()`` + ``finish_forward()``, 4 chunks) for a
   separate, grouped and tied head, FSDP and, when the world is even and >= 4,
   HSDP (2 x world/2), next to the non-chunked program (method ``d``, full
   logits, the same sharded model): per optimizer step, the max abs difference
   of the full gradients, and FSDP's gradient reductions (``foreach_reduce``
   calls, one per group and reduction; a world of 1 reduces by a copy) and
   reduce-scatters against the minimum, one per group with parameters. Then a
   PP step: ``ScheduleGPipe`` over FSDP stages (PP2 x DP world/2; one stage when
   the world is 1 or odd), the chunked loss under ``partial_backward``, against
   a single-device non-chunked reference.
2. **memory at scale**: one process, torch's fake process group
   (``torch.testing._internal.distributed.fake_pg``) at world 8, so the shards
   are a rank's of 8 and nothing is communicated; a Llama-3-8B-like shape
   (vocab 128,256, dim 4,096, 2 blocks, seq 4,096), bf16 parameters and fp32
   reduction, grouped head (torchtitan's ``[norm, output]``), 2 microbatches
   with sync on the last. Per method, over the second optimizer step: the peak
   allocated memory above the step's start (CUDA:
   ``torch.cuda.max_memory_allocated``; CPU: the peak of the running sum of the
   profiler's allocation records, as benchmark 3), and the head group's
   resident bytes when each decoder block's backward starts (the storage of its
   unsharded weights; its unsharded gradients), max over the step. Methods:
   full logits; torchtitan 0.3.0's ``ChunkedLossWrapper`` as released; the same
   with the consumer series; this series' API loop.
3. **overlap**: NCCL ranks without the sanitizer (2 gloo ranks with ``--cpu``),
   the same shape and methods, the profiler over one step: the device work
   that the head group's reduction (``foreach_reduce`` in its post-backward)
   launched on streams other than the compute stream, and how much of its time
   overlaps the decoder backward's kernels on the compute stream. On CPU there
   are no streams (gloo runs collectives in the calling thread): only whether
   the head's reduction was issued before the decoder backward of the reducing
   microbatch.
4. **step time**: the same processes as part 3, median of ``--steps`` steps
   per method after one warm-up, ratios to full logits in the same run.

Writes one JSON file (``--out``; default ``tools/bench/results/gpu-check.json``
on CUDA, ``gpu-check-cpu.json`` in the temporary directory with ``--cpu``), the
results-file meta of ``tools/bench/results.py`` plus the machine, and prints
its tables (``render.gpu_check_tables``; ``python tools/bench/render.py`` puts
a committed ``gpu-check.json`` into docs/benchmarks.md). Exits 1 when a check
fails: the series' gradients differ from the non-chunked program's, its
reductions are not at the minimum, a chunked method's peak is not below full
logits, the series holds the head's weight in the decoder backward, or a part
raised (the sanitizer's errors included).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import gc
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent / "bench"
sys.path.insert(0, str(BENCH))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard  # noqa: E402
from torch.profiler import ProfilerActivity, profile, record_function  # noqa: E402

import common  # noqa: E402
import memory  # noqa: E402
import render  # noqa: E402
import results  # noqa: E402
from counting import CallLog  # noqa: E402

MICROBATCHES, NUM_CHUNKS, SCALE_WORLD = 2, 4, 8
#: The parts' shapes: CUDA sized for one data-center GPU (80 GB; the whole run within 8 minutes),
#: ``--cpu`` tiny (a head large against the blocks, so that chunking shows in the peak).
SHAPES = {
    "cuda": {"check": {"vocab": 2048, "dim": 128, "layers": 2, "batch": 2, "seq": 64},
             "scale": {"vocab": 128256, "dim": 4096, "layers": 2, "batch": 1, "seq": 4096},
             "perf": {"vocab": 128256, "dim": 4096, "layers": 2, "batch": 1, "seq": 4096}},
    "cpu": {"check": {"vocab": 64, "dim": 8, "layers": 2, "batch": 2, "seq": 8},
            "scale": {"vocab": 4096, "dim": 16, "layers": 2, "batch": 1, "seq": 128},
            "perf": {"vocab": 256, "dim": 8, "layers": 2, "batch": 1, "seq": 16}},
}
#: Method names of parts 2-4; ``released``/``patched``: torchtitan's wrapper (common's method b)
METHODS = tuple(render.GPU_CHECK_METHODS)
#: Gradients "equal" to the non-chunked program's: max abs difference within this share of the largest
#: gradient entry (fp32, TF32 off; the chunks only change the summation order)
GRAD_RTOL = 1e-4
MARK = "gpu_check"
HEAD_MARK = f"{MARK}.head_reduction"


# --------------------------------------------------------------------------- shared pieces


def rank_device(device_type: str) -> torch.device:
    """This rank's device (``launch`` has set the current CUDA device of an NCCL rank)."""
    return torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def batch(gen: torch.Generator, shape: dict, device: torch.device, rows: int = 0):
    size = (rows or shape["batch"], shape["seq"])
    return (torch.randint(0, shape["vocab"], size, generator=gen).to(device),
            torch.randint(0, shape["vocab"], size, generator=gen).to(device))


class Counts:
    """FSDP's gradient reductions (``foreach_reduce`` calls: one per group and reduction, whatever the
    world size) and the collectives (:class:`counting.CallLog`) issued inside :meth:`count`."""

    def __init__(self) -> None:
        self.log = CallLog()
        self.reductions = 0

    @contextlib.contextmanager
    def count(self):
        from torch.distributed.fsdp._fully_shard import _fsdp_param_group

        original = _fsdp_param_group.foreach_reduce

        def foreach_reduce(*args, **kwargs):
            self.reductions += 1
            return original(*args, **kwargs)

        _fsdp_param_group.foreach_reduce = foreach_reduce
        try:
            with self.log.count():
                yield self
        finally:
            _fsdp_param_group.foreach_reduce = original

    def totals(self) -> dict:
        c = self.log.counts
        return {"reductions": self.reductions, "reduce_scatter": c["reduce_scatter"],
                "all_reduce": c["all_reduce"], "all_gather": c["all_gather"]}


def on_block_backward(model: common.TinyLM, callback) -> list:
    """Calls ``callback("start" | "end", i)`` when decoder block ``i``'s backward compute starts (the
    gradient of its output is ready) and ends (the gradient of its input is ready, just before FSDP's
    post-backward of the block); returns the hook handles."""
    handles = []
    for i, layer in enumerate(model.layers):
        def pre(module, args, i=i):
            if isinstance(args[0], torch.Tensor) and args[0].requires_grad:
                args[0].register_hook(lambda g: callback("end", i))

        def post(module, args, out, i=i):
            if out.requires_grad:
                out.register_hook(lambda g: callback("start", i))

        handles += [layer.register_forward_pre_hook(pre), layer.register_forward_hook(post)]
    return handles


def head_groups(model: common.TinyLM) -> list:
    return model.lm_head._get_fsdp_state()._fsdp_param_groups


def head_resident(model: common.TinyLM) -> tuple[int, int]:
    """Bytes the head group holds now: the storage of its unsharded (all-gathered) weights, and its
    unsharded gradients (FSDP2 internals, fine for a check)."""
    weight = grad = 0
    for group in head_groups(model):
        for fsdp_param in group.fsdp_params:
            weight += sum(t.untyped_storage().nbytes() for t in fsdp_param.all_gather_outputs)
            param = getattr(fsdp_param, "_unsharded_param", None)
            if param is not None and param.grad is not None:
                grad += param.grad.untyped_storage().nbytes()
    return weight, grad


@contextlib.contextmanager
def marked_head_reduction(model: common.TinyLM):
    """Runs the head group's gradient reductions (``foreach_reduce`` called by its post-backward: where
    FSDP issues the reduce-scatter) inside a profiler range named :data:`HEAD_MARK`."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group

    cls = _fsdp_param_group.FSDPParamGroup
    post_backward, foreach_reduce = cls.post_backward, _fsdp_param_group.foreach_reduce
    heads = head_groups(model)
    in_head = [False]

    def marked_post_backward(group, *args, **kwargs):
        in_head.append(any(group is h for h in heads))
        try:
            return post_backward(group, *args, **kwargs)
        finally:
            in_head.pop()

    def marked_reduce(*args, **kwargs):
        if not in_head[-1]:
            return foreach_reduce(*args, **kwargs)
        with record_function(HEAD_MARK):
            return foreach_reduce(*args, **kwargs)

    cls.post_backward, _fsdp_param_group.foreach_reduce = marked_post_backward, marked_reduce
    try:
        yield
    finally:
        cls.post_backward, _fsdp_param_group.foreach_reduce = post_backward, foreach_reduce


def wrapper_classes() -> dict:
    """``{"released": cls, "patched": cls}`` for the torchtitan wrappers available here."""
    try:
        import torchtitan.components.loss as installed
    except Exception:
        return {}
    try:
        from torchtitan_chunked import released_loss_module

        return {"released": released_loss_module().ChunkedLossWrapper, "patched": installed.ChunkedLossWrapper}
    except Exception:  # no consumer marker: the installed torchtitan is the released one
        return {"released": installed.ChunkedLossWrapper}


def step_fns(methods, tokens_per_step: int) -> dict:
    classes = wrapper_classes()
    fns = {"full": common.microbatch_d, "series": common.microbatch_a}
    for name in ("released", "patched"):
        if name in methods:
            fns[name] = common.make_microbatch_b(NUM_CHUNKS, tokens_per_step, classes[name])
    return {m: fns[m] for m in methods}


def run_step(model, optim, fn, batches, tokens_per_step: int) -> None:
    """One optimizer step over the microbatches, reduced on the last."""
    for mb, (tokens, labels) in enumerate(batches):
        fn(model, tokens, labels, num_chunks=NUM_CHUNKS, scale=1.0 / tokens_per_step,
           last=mb == len(batches) - 1)
    optim.step()
    optim.zero_grad()


def build_scaled(shape: dict, mesh, device: torch.device) -> common.TinyLM:
    """The LM of parts 2-4: built on the meta device, FSDP with bf16 parameters and fp32 reduction,
    grouped head, then materialized shard by shard on ``device``."""
    with torch.device("meta"):
        model = common.TinyLM(vocab_size=shape["vocab"], dim=shape["dim"], num_layers=shape["layers"])
    common.shard(model, head="grouped", mesh=mesh,
                 mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    model.to_empty(device=device)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            local = p.to_local()
            local.fill_(1.0) if local.ndim == 1 else local.normal_(0.0, 0.02)
    return model


# --------------------------------------------------------------------------- 1. correctness


def grad_diff(model, reference) -> tuple[float, float]:
    """Max abs difference of the full gradients, and the reference's largest entry."""
    diff = largest = 0.0
    for p, q in zip(model.parameters(), reference.parameters()):
        g, r = p.grad.full_tensor(), q.grad.full_tensor()
        diff = max(diff, (g - r).abs().max().item())
        largest = max(largest, r.abs().max().item())
    return diff, largest


def check_chunked(mesh, head: str, shape: dict, device, steps: int) -> dict:
    """Series API (a) vs full logits (d) on the same sharded model, ``steps`` optimizer steps."""
    models = {}
    for method in ("a", "d"):
        torch.manual_seed(0)
        model = common.TinyLM(vocab_size=shape["vocab"], dim=shape["dim"], num_layers=shape["layers"],
                              tied=head == "tied")
        groups = common.shard(model, head=head, mesh=mesh)
        models[method] = (model, torch.optim.SGD(model.parameters(), lr=0.1))
    tokens_per_step = shape["batch"] * shape["seq"] * MICROBATCHES
    gen = torch.Generator().manual_seed(1000 + dist.get_rank())
    diffs, counts = [], {}
    for _ in range(steps):
        batches = [batch(gen, shape, device) for _ in range(MICROBATCHES)]
        for method, (model, optim) in models.items():
            fn = common.microbatch_fn(method, num_chunks=NUM_CHUNKS, tokens_per_step=tokens_per_step)
            with Counts().count() as counter:
                for mb, (tokens, labels) in enumerate(batches):
                    fn(model, tokens, labels, num_chunks=NUM_CHUNKS, scale=1.0 / tokens_per_step,
                       last=mb == MICROBATCHES - 1)
            counts[method] = counter.totals()
        diffs.append(grad_diff(models["a"][0], models["d"][0]))
        for model, optim in models.values():
            optim.step()
            optim.zero_grad()
    hsdp = mesh.ndim == 2
    return {"part": "chunked", "config": f"HSDP {mesh.size(0)}x{mesh.size(1)}" if hsdp else f"FSDP {mesh.size()}",
            "head": head, "groups": groups, "shard_size": mesh.size(mesh.ndim - 1), "hsdp": hsdp,
            "max_grad_diff": max(d for d, _ in diffs), "max_grad": max(g for _, g in diffs),
            "series": counts["a"], "full": counts["d"]}


def check_pp(world: int, shape: dict, device, steps: int) -> dict:
    """ScheduleGPipe over FSDP stages, chunked loss under ``partial_backward``, vs a single-device
    non-chunked reference (the same on every rank)."""
    from pp_collectives import make_chunked_loss
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    pp = 2 if world % 2 == 0 else 1
    mesh = init_device_mesh(device.type, (pp, world // pp), mesh_dim_names=("pp", "dp"))
    pp_rank = mesh["pp"].get_local_rank()
    layers = shape["layers"] * pp
    torch.manual_seed(0)
    model = common.TinyLM(vocab_size=shape["vocab"], dim=shape["dim"], num_layers=layers)
    reference = copy.deepcopy(model).to(device)
    per = layers // pp
    module = common.Stage(model, range(pp_rank * per, (pp_rank + 1) * per), first=pp_rank == 0,
                          last=pp_rank == pp - 1)
    for layer in module.layers.values():
        fully_shard(layer, mesh=mesh["dp"])
    if module.lm_head is not None:
        fully_shard(module.lm_head, mesh=mesh["dp"])
    fully_shard(module, mesh=mesh["dp"])
    groups = sum(len(m._get_fsdp_state()._fsdp_param_groups) for m in module.modules() if isinstance(m, FSDPModule))
    stage = PipelineStage(module, pp_rank, pp, device, group=mesh["pp"].get_group())
    microbatches = 2 * MICROBATCHES
    schedule = ScheduleGPipe(stage, n_microbatches=microbatches, loss_fn=make_chunked_loss(module.lm_head))
    optims = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (module, reference)]
    ref_params = dict(reference.named_parameters())
    diff = largest = 0.0
    for step in range(steps):
        tokens, labels = batch(torch.Generator().manual_seed(step), shape, device, rows=microbatches * shape["batch"])
        with Counts().count() as counter:
            schedule.step(*((tokens,) if module.tok_embeddings is not None else ()),
                          **({"target": labels} if module.lm_head is not None else {}))
        # The schedule averages the microbatches' losses (scale_grads): the reference's mean over all tokens
        F.cross_entropy(reference.lm_head(reference(tokens)).flatten(0, 1), labels.flatten()).backward()
        for name, p in module.named_parameters():
            r = ref_params[name].grad
            diff = max(diff, (p.grad.full_tensor() - r).abs().max().item())
            largest = max(largest, r.abs().max().item())
        for optim in optims:
            optim.step()
            optim.zero_grad()
    worst = torch.tensor([diff, largest], device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    per_rank: list = [None] * world
    dist.all_gather_object(per_rank, {"groups": groups, **counter.totals()})
    return {"part": "pp", "config": f"PP{pp} x DP{world // pp}, GPipe, {microbatches} microbatches",
            "head": "separate", "shard_size": world // pp, "max_grad_diff": worst[0].item(),
            "max_grad": worst[1].item(), "ranks": per_rank}


def check_rank(rank: int, world: int, device_type: str, shape: dict, steps: int) -> dict:
    device = rank_device(device_type)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    from torch.cuda import _sanitizer

    out = {"sanitizer": bool(_sanitizer.cuda_sanitizer.enabled), "rows": []}
    configs = ["fsdp"] + (["hsdp"] if world >= 4 and world % 2 == 0 else [])
    for config in configs:
        mesh = common.make_mesh(config, device.type)
        for head in common.HEADS:
            out["rows"].append(check_chunked(mesh, head, shape, device, steps))
            if rank == 0:
                progress(row_line(out["rows"][-1]))
    out["rows"].append(check_pp(world, shape, device, steps))
    if rank == 0:
        progress(row_line(out["rows"][-1]))
    return out


# --------------------------------------------------------------------------- 2. memory at scale


@contextlib.contextmanager
def peak_memory(device: torch.device, out: dict):
    """``out["peak_bytes"]``: the peak allocated above the start (CUDA allocator statistics; on CPU the
    profiler's allocation records, :func:`memory.peak_bytes`)."""
    if device.type == "cuda":
        synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
        yield
        synchronize(device)
        out["peak_bytes"] = torch.cuda.max_memory_allocated(device) - start
        out["start_bytes"] = start
    else:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            yield
        out["peak_bytes"] = memory.peak_bytes(prof)


def scale_rank(rank: int, world: int, device_type: str, shape: dict, methods: list[str]) -> list[dict]:
    device = rank_device(device_type)
    mesh = common.make_mesh("fsdp", device.type)
    tokens_per_step = shape["batch"] * shape["seq"] * MICROBATCHES
    fns = step_fns(methods, tokens_per_step)
    rows = []
    for name in methods:
        model = build_scaled(shape, mesh, device)
        optim = torch.optim.SGD(model.parameters(), lr=1e-3)
        gen = torch.Generator().manual_seed(0)
        run_step(model, optim, fns[name], [batch(gen, shape, device) for _ in range(MICROBATCHES)], tokens_per_step)
        held = {"weight": 0, "grad": 0, "blocks": 0}

        def at_block(kind: str, i: int, model=model, held=held) -> None:
            if kind == "start":
                weight, grad = head_resident(model)
                held.update(weight=max(held["weight"], weight), grad=max(held["grad"], grad),
                            blocks=held["blocks"] + bool(weight))

        handles = on_block_backward(model, at_block)
        row: dict = {"method": name}
        with peak_memory(device, row):
            run_step(model, optim, fns[name], [batch(gen, shape, device) for _ in range(MICROBATCHES)],
                     tokens_per_step)
        for h in handles:
            h.remove()
        row.update(head_weight_bytes=held["weight"], head_grad_bytes=held["grad"],
                   blocks_with_head_weight=held["blocks"], blocks=shape["layers"] * MICROBATCHES)
        rows.append(row)
        progress(memory_line(row))
        del model, optim, handles
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


# --------------------------------------------------------------------------- 3./4. overlap and step time


def _merged(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def profile_records(prof) -> tuple[list, dict, list]:
    """From the profiler's kineto events: the marks ``(start, end, name)`` (:data:`MARK` ranges); the
    operators' starts ``{id: start}`` (CPU events linked to nothing; device work links to its operator
    by ``linked_correlation_id``, as ``torch.autograd.profiler`` attaches kernels to operators); the
    device work ``(name, start, end, stream, operator id)``. Times in ns."""
    from torch._C._autograd import DeviceType

    marks, ops, work = [], {}, []
    for e in prof.profiler.kineto_results.events():
        if e.device_type() == DeviceType.CPU:
            if e.name().startswith(MARK):
                marks.append((e.start_ns(), e.end_ns(), e.name()))
            elif e.linked_correlation_id() == 0:
                ops.setdefault(e.correlation_id(), e.start_ns())
        elif e.activity_type() != "gpu_user_annotation":
            work.append((e.name(), e.start_ns(), e.end_ns(), e.device_resource_id(), e.linked_correlation_id()))
    return marks, ops, work


def analyse_overlap(marks: list, ops: dict, work: list, num_layers: int) -> dict:
    """The head group's reductions (:data:`HEAD_MARK` ranges), the decoder backward windows (from the
    top block's backward start to ``layers.0``'s end, one per microbatch) and, with device work, the
    work launched inside them (by operators that started there): the head's on streams other than the
    compute stream (the one most decoder-backward work ran on), and how long it overlaps the decoder's."""
    heads = sorted((s, t) for s, t, n in marks if n == HEAD_MARK)
    ends = sorted(s for s, _, n in marks if n == f"{MARK}.end.0")
    windows: list[tuple[int, int]] = []
    for s in sorted(s for s, _, n in marks if n == f"{MARK}.start.{num_layers - 1}"):
        end = next((t for t in ends if t >= s), None)
        if end is not None and not (windows and windows[-1][1] == end):
            windows.append((s, end))
    out: dict = {"head_reduce_calls": len(heads), "decoder_bwd_windows": len(windows)}
    if windows:  # the reducing (last) microbatch: head reductions issued before its decoder backward
        after = windows[-2][1] if len(windows) > 1 else -1
        out["head_reduce_before_decoder_bwd"] = sum(after <= s and t <= windows[-1][0] for s, t in heads)

    def launched_in(w, ranges) -> bool:
        t = ops.get(w[4])
        return t is not None and any(a <= t <= b for a, b in ranges)

    decoder = [w for w in work if launched_in(w, windows)]
    if not decoder:
        return out
    compute = collections.Counter(w[3] for w in decoder).most_common(1)[0][0]
    busy = _merged([(w[1], w[2]) for w in decoder if w[3] == compute])
    head = [w for w in work if launched_in(w, heads) and w[3] != compute]
    overlap = sum(max(0, min(w[2], b) - max(w[1], a)) for w in head for a, b in busy)
    head_ns = sum(w[2] - w[1] for w in head)
    out.update(head_reduce_kernels=len(head), head_reduce_kernel_names=sorted({w[0][:60] for w in head}),
               head_reduce_us=head_ns / 1e3, overlap_us=overlap / 1e3,
               overlap_share=overlap / head_ns if head_ns else None,
               decoder_bwd_kernel_us=sum(b - a for a, b in busy) / 1e3, compute_stream=compute,
               head_streams=sorted({w[3] for w in head}))
    return out


def profiled_step(model, optim, fn, batches, tokens_per_step: int, device, num_layers: int) -> dict:
    def mark(kind: str, i: int) -> None:
        with record_function(f"{MARK}.{kind}.{i}"):
            pass

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    handles = on_block_backward(model, mark)
    try:
        with marked_head_reduction(model), profile(activities=activities) as prof:
            run_step(model, optim, fn, batches, tokens_per_step)
            synchronize(device)
    finally:
        for h in handles:
            h.remove()
    return analyse_overlap(*profile_records(prof), num_layers)


def perf_rank(rank: int, world: int, device_type: str, shape: dict, methods: list[str], steps: int) -> dict:
    device = rank_device(device_type)
    mesh = common.make_mesh("fsdp", device.type)
    tokens_per_step = shape["batch"] * shape["seq"] * MICROBATCHES
    fns = step_fns(methods, tokens_per_step)
    gen = torch.Generator().manual_seed(rank)
    times: dict[str, list[float]] = {}
    overlap = {}
    for name in methods:
        model = build_scaled(shape, mesh, device)
        optim = torch.optim.SGD(model.parameters(), lr=1e-3)
        times[name] = []
        for step in range(1 + steps):  # the first does lazy init: not timed
            batches = [batch(gen, shape, device) for _ in range(MICROBATCHES)]
            synchronize(device)
            dist.barrier()
            start = time.perf_counter()
            run_step(model, optim, fns[name], batches, tokens_per_step)
            synchronize(device)
            if step:
                times[name].append(time.perf_counter() - start)
        if name != "full":
            overlap[name] = profiled_step(model, optim, fns[name], batches, tokens_per_step, device,
                                          shape["layers"])
        if rank == 0:
            progress(perf_line(name, times[name], overlap.get(name)))
        del model, optim
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {"times": times, "overlap": overlap}


# --------------------------------------------------------------------------- checks and main


def checks(params: dict, res: dict) -> list[dict]:
    """The consistency checks the exit status (and the CI test) rests on."""
    out = []

    def check(name: str, ok: bool, detail: str) -> None:
        out.append({"check": name, "ok": bool(ok), "detail": detail})

    for part in ("correctness", "memory", "perf"):
        if isinstance(res.get(part), dict) and "error" in res[part]:
            check(f"{part} ran", False, res[part]["error"].strip().splitlines()[-1])
    corr = res.get("correctness", {})
    if params["device"] == "cuda" and "sanitizer" in corr:
        check("CUDA sanitizer on", corr["sanitizer"], "torch.cuda._sanitizer enabled in the ranks")
    for row in corr.get("rows", []):
        label = f"{row['config']}, {row['head']} head"
        check(f"{label}: gradients", row["max_grad_diff"] <= GRAD_RTOL * row["max_grad"],
              f"max |g - g_ref| {row['max_grad_diff']:.3g} <= {GRAD_RTOL:g} x {row['max_grad']:.3g}")
        per_rank = row["ranks"] if row["part"] == "pp" else [{"groups": row["groups"], **row["series"]}]
        for i, counts in enumerate(per_rank):
            g = counts["groups"]
            want = {"reductions": g, "reduce_scatter": g if row["shard_size"] > 1 else 0,
                    **({"all_reduce": g} if row.get("hsdp") else {})}
            got = {k: counts[k] for k in want}
            check(f"{label}{f', rank {i}' if row['part'] == 'pp' else ''}: reductions at the minimum",
                  got == want, f"{got} (minimum {want})")
    mem = {r["method"]: r for r in res.get("memory", []) if isinstance(r, dict)}
    if "full" in mem:
        for name, r in mem.items():
            if name != "full":
                check(f"memory: {name} peak below full logits", r["peak_bytes"] < mem["full"]["peak_bytes"],
                      f"{r['peak_bytes']} < {mem['full']['peak_bytes']} bytes")
    if "series" in mem:
        check("memory: series frees the head's weight before the decoder backward",
              mem["series"]["head_weight_bytes"] == 0, f"{mem['series']['head_weight_bytes']} bytes held")
    return out


def progress(line: str) -> None:
    print(line, flush=True)


def _counts(c: dict) -> str:
    return f"reductions {c['reductions']}, RS {c['reduce_scatter']}, AR {c['all_reduce']}, AG {c['all_gather']}"


def row_line(row: dict) -> str:
    grads = f"max |grad - non-chunked| {row['max_grad_diff']:.2e} (largest entry {row['max_grad']:.2e})"
    if row["part"] == "pp":
        ranks = "; ".join(f"rank {i}: {r['groups']} groups, {_counts(r)}" for i, r in enumerate(row["ranks"]))
        return f"  {row['config']}: {grads}; {ranks}"
    return (f"  {row['config']}, {row['head']} head, {row['groups']} groups: {grads}; "
            f"series {_counts(row['series'])}; full logits {_counts(row['full'])}")


def memory_line(row: dict) -> str:
    return (f"  {render.GPU_CHECK_METHODS[row['method']]}: peak {row['peak_bytes'] / 2**20:.1f} MiB above the "
            "step's start; "
            f"head weight held {row['head_weight_bytes'] / 2**20:.1f} MiB in {row['blocks_with_head_weight']} of "
            f"{row['blocks']} block backwards, head grads {row['head_grad_bytes'] / 2**20:.1f} MiB")


def perf_line(name: str, times: list[float], overlap) -> str:
    line = f"  {render.GPU_CHECK_METHODS[name]}: median {statistics.median(times) * 1e3:.1f} ms/step"
    if overlap:
        line += (f"; head reductions {overlap['head_reduce_calls']}, "
                 f"{overlap.get('head_reduce_before_decoder_bwd', '-')} before the reducing decoder backward")
        if "overlap_us" in overlap:
            line += (f"; head reduce kernels {overlap['head_reduce_us']:.0f} us, "
                     f"{overlap['overlap_us']:.0f} us overlapped")
    return line


def machine(cpu: bool) -> dict:
    if cpu:
        return {"device": "cpu"}
    props = torch.cuda.get_device_properties(0)
    return {"device": "cuda", "gpu": props.name, "gpu_memory_gib": round(props.total_memory / 2**30, 1),
            "gpus": torch.cuda.device_count(), "cuda": torch.version.cuda,
            "nccl": ".".join(map(str, torch.cuda.nccl.version()))}


def available_methods() -> tuple[list[str], str]:
    classes = wrapper_classes()
    note = "" if len(classes) == 2 else (
        "torchtitan is not importable: no wrapper rows" if not classes else
        "the torchtitan consumer series is not applied: no patched-wrapper row")
    return [m for m in METHODS if m in ("full", "series") or m in classes], note


def run_part(name: str, fn, world: int, *args, backend: str, start_method: str, env: dict):
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    start = time.perf_counter()
    try:
        out = common.launch(fn, world, *args, backend=backend, start_method=start_method)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    progress(f"{name}: {'FAILED' if isinstance(out, dict) and 'error' in out else 'done'} "
             f"in {time.perf_counter() - start:.1f} s")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--cpu", action="store_true", help="tiny sizes on CPU: gloo ranks, the fake process group")
    p.add_argument("--world-size", type=int, help="ranks of parts 1, 3 and 4 (default: the GPU count; with --cpu 4, "
                   "and at most 2 for parts 3-4)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per method (default 5; 1 with --cpu)")
    p.add_argument("--out", type=Path, help="the JSON file (default: tools/bench/results/gpu-check.json on CUDA, "
                   "gpu-check-cpu.json in the temporary directory with --cpu)")
    args = p.parse_args(argv)
    if not args.cpu and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here (torch.cuda.is_available() is False); run it on a CUDA machine, "
              "or pass --cpu for the small CPU form", file=sys.stderr)
        return 2
    if not common.has_series_api():
        print(f"gpu_check: torch {torch.__version__} lacks the series (FSDPModule.partial_backward); "
              "apply it: python -m torch_patches apply", file=sys.stderr)
        return 2
    load_before = results.load()
    kind = "cpu" if args.cpu else "cuda"
    world = args.world_size or (4 if args.cpu else torch.cuda.device_count())
    steps = args.steps or (1 if args.cpu else 5)
    out_path = args.out or (Path(tempfile.gettempdir()) / "gpu-check-cpu.json" if args.cpu
                            else results.REPO / "tools" / "bench" / "results" / "gpu-check.json")
    shapes = SHAPES[kind]
    methods, note = available_methods()
    launch = {"backend": "gloo" if args.cpu else "nccl", "start_method": "fork" if args.cpu else "spawn"}
    progress(f"gpu_check: torch {torch.__version__} ({results.torch_series()}), {kind}, world {world}; "
             f"methods {', '.join(methods)}{'; ' + note if note else ''}")
    res: dict = {}
    progress(f"[1/3] correctness: {launch['backend']} world {world}, "
             f"{'TORCH_CUDA_SANITIZER=1' if not args.cpu else 'no sanitizer on CPU'}, "
             f"{render.shape_text(shapes['check'])}")
    res["correctness"] = run_part("correctness", check_rank, world, kind, shapes["check"], 2, **launch,
                                  env={} if args.cpu else {"TORCH_CUDA_SANITIZER": "1"})
    progress(f"[2/3] memory at scale: fake process group, world {SCALE_WORLD}, {render.shape_text(shapes['scale'])}")
    res["memory"] = run_part("memory", scale_rank, SCALE_WORLD, kind, shapes["scale"], methods, backend="fake",
                             start_method=launch["start_method"], env={})
    # On CPU two ranks run the same code as four, in less time on a small machine
    perf_world = min(world, 2) if args.cpu else world
    progress(f"[3/3] overlap and step time: {launch['backend']} world {perf_world}, "
             f"{render.shape_text(shapes['perf'])}, "
             f"{steps} timed steps per method")
    res["perf"] = run_part("perf", perf_rank, perf_world, kind, shapes["perf"], methods, steps, **launch, env={})
    command = "python tools/gpu_check.py" + " --cpu" * args.cpu + "".join(
        f" --{k.replace('_', '-')} {v}" for k, v in vars(args).items()
        if k not in ("cpu", "out") and v is not None)
    params = {"command": command, "device": kind, "world_size": world, "perf_world_size": perf_world,
              "scale_world_size": SCALE_WORLD,
              "shapes": shapes, "microbatches": MICROBATCHES, "num_chunks": NUM_CHUNKS, "steps": steps,
              "methods": methods, "note": note, "torch_series": results.torch_series(),
              "machine": machine(args.cpu), "grad_rtol": GRAD_RTOL}
    res["checks"] = checks(params, res)
    results.write(out_path, "gpu_check", params, res, load_before, torch.__version__)
    print(render.gpu_check_tables(results.read(out_path)))
    failed = [c for c in res["checks"] if not c["ok"]]
    progress(f"wrote {out_path}; checks: {len(res['checks']) - len(failed)} of {len(res['checks'])} passed"
             + "".join(f"\nFAILED {c['check']}: {c['detail']}" for c in failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
