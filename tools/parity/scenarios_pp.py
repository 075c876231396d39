"""Pipelining scenarios: every 2.15.0 schedule class with plain, FSDP,
replicate() and DDP stages, and stages that are plain containers of FSDP
modules (only APIs torch 2.15.0 has)."""

import functools

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
)

from catalogue import register

VOCAB, DIM, SEQ = 16, 8, 4
MB_SIZE = 2
LR = 0.1

#: name -> (class, stage placement: "single" one stage per rank, "loop" r and r+pp, "v" r and 2pp-1-r)
SCHEDULES = {
    "gpipe": (ScheduleGPipe, "single"),
    "1f1b": (Schedule1F1B, "single"),
    "interleaved_1f1b": (ScheduleInterleaved1F1B, "loop"),
    "looped_bfs": (ScheduleLoopedBFS, "loop"),
    "interleaved_zb": (ScheduleInterleavedZeroBubble, "loop"),
    "zbv": (ScheduleZBVZeroBubble, "v"),
    "dualpipev": (ScheduleDualPipeV, "v"),
}
KINDS = ("plain", "fsdp", "replicate", "ddp")


class Layer(nn.Module):
    def __init__(self, autograd_in_forward: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)
        self.autograd_in_forward = autograd_in_forward

    def forward(self, x):
        if self.autograd_in_forward and torch.is_grad_enabled():
            # A forward that uses autograd itself when the caller enables grad
            # (an input-gradient feature); without grad it skips the feature
            probe = x.detach().requires_grad_(True)
            (g,) = torch.autograd.grad((probe * probe).sum(), probe)
            x = x + 0.01 * g
        return x + torch.tanh(self.lin(x))


class Full(nn.Module):
    def __init__(self, num_layers: int, autograd_in_forward: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList([Layer(autograd_in_forward) for _ in range(num_layers)])
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)


class StageMod(nn.Module):
    def __init__(self, full: Full, layer_ids, first: bool, last: bool, head_in_forward: bool) -> None:
        super().__init__()
        self.embed = full.embed if first else None
        self.layers = nn.ModuleList([full.layers[i] for i in layer_ids])
        self.norm = full.norm if last else None
        self.head = full.head if last else None
        self.head_in_forward = head_in_forward

    def forward(self, x):
        if self.embed is not None:
            x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        if self.head is not None and self.head_in_forward:
            x = self.head(self.norm(x))
        return x


def _ce(logits, target):
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


class Pipeline:
    """One pipeline (and its data) on this rank; records what it observes."""

    def __init__(self, ctx, sched: str, kind: str, *, pp: int = 2, n_mb: int = 4, loss: str = "plain",
                 scale_grads: bool = True, autograd_in_forward: bool = False, hooks=None) -> None:
        self.ctx = ctx
        cls, placement = SCHEDULES[sched]
        dp = ctx.world // pp
        mesh = init_device_mesh("cpu", (pp, dp), mesh_dim_names=("pp", "dp"))
        self.pp_group = mesh["pp"].get_group()
        self.dp_mesh = mesh["dp"]
        self.pp_rank = mesh["pp"].get_local_rank()
        self.dp_rank = mesh["dp"].get_local_rank()
        if placement == "single":
            num_stages, indices = pp, [self.pp_rank]
        elif placement == "loop":
            num_stages, indices = 2 * pp, [self.pp_rank, self.pp_rank + pp]
        else:
            num_stages, indices = 2 * pp, sorted([self.pp_rank, 2 * pp - 1 - self.pp_rank])
        self.num_stages = num_stages
        self.n_mb = n_mb
        torch.manual_seed(0)
        full = Full(num_stages, autograd_in_forward)
        head_in_forward = loss != "own_backward"
        self.stage_mods = {}
        stages = []
        for idx in indices:
            first, last = idx == 0, idx == num_stages - 1
            mod = StageMod(full, [idx], first, last, head_in_forward)
            mod = self._wrap(mod, kind, last)
            self.stage_mods[idx] = mod
            stages.append(PipelineStage(mod, idx, num_stages, torch.device("cpu"), group=self.pp_group))
        self.stages = stages
        self.has_first = 0 in self.stage_mods
        self.has_last = num_stages - 1 in self.stage_mods
        self.container = nn.ModuleDict({str(i): m for i, m in self.stage_mods.items()})
        self.optim = torch.optim.SGD(self.container.parameters(), lr=LR)
        self.hooks = hooks or {}
        loss_fn = self._own_backward_loss if loss == "own_backward" else self._loss
        target = stages[0] if len(stages) == 1 else stages
        self.schedule = cls(target, n_microbatches=n_mb, loss_fn=loss_fn, scale_grads=scale_grads)
        self.step_index = 0

    # ---- construction
    def _wrap(self, mod, kind, last):
        if kind in ("fsdp", "container"):
            for layer in mod.layers:
                fully_shard(layer, mesh=self.dp_mesh)
            if last:
                fully_shard(mod.head, mesh=self.dp_mesh)
            if kind == "fsdp":
                fully_shard(mod, mesh=self.dp_mesh)
            # "container": the stage module stays a plain module holding FSDP
            # modules (fully_shard per block, the stage left unwrapped)
        elif kind == "replicate":
            from torch.distributed._composable.replicate_with_fsdp import replicate

            for layer in mod.layers:
                replicate(layer, mesh=self.dp_mesh)
            replicate(mod, mesh=self.dp_mesh)
        elif kind == "ddp":
            from torch.nn.parallel import DistributedDataParallel as DDP

            mod = DDP(mod, process_group=self.dp_mesh.get_group())
        return mod

    def module(self, idx):
        mod = self.stage_mods[idx]
        return getattr(mod, "module", mod)

    # ---- losses
    def _loss(self, output, target):
        hook = self.hooks.get("loss")
        if hook is not None:
            hook(self)
        return _ce(output, target)

    def _own_backward_loss(self, h, target):
        """Runs the head and its backward itself; returns a surrogate for the decoder."""
        hook = self.hooks.get("loss")
        if hook is not None:
            hook(self)
        last = self.module(self.num_stages - 1)
        if not torch.is_grad_enabled() or not h.requires_grad:
            return _ce(last.head(last.norm(h)), target)
        h_detached = h.detach().requires_grad_(True)
        loss = _ce(last.head(last.norm(h_detached)), target)
        loss.backward()
        surrogate = (h * h_detached.grad).sum()
        return surrogate - surrogate.detach() + loss.detach()

    # ---- data
    def inputs(self, step):
        gen = torch.Generator().manual_seed(100 * step + self.dp_rank)
        tokens = torch.randint(0, VOCAB, (self.n_mb * MB_SIZE, SEQ), generator=gen)
        labels = torch.randint(0, VOCAB, (self.n_mb * MB_SIZE, SEQ), generator=gen)
        args = (tokens,) if self.has_first else ()
        kwargs = {"target": labels} if self.has_last else {}
        return args, kwargs

    # ---- running
    def flags(self):
        self.ctx.record("flags", [[s.stage_index, s.is_first, s.is_last, s.has_backward] for s in self.stages],
                       self.schedule.scale_grads, torch.is_grad_enabled())
        self.ctx.public_state(self.container)

    def step(self, *, eval_mode=False, data_step=None, **kwargs):
        ctx = self.ctx
        data_step = self.step_index if data_step is None else data_step
        args, kw = self.inputs(data_step)
        losses = []
        label = "eval" if eval_mode else "step"
        ctx.phase(f"{label} {data_step} {kwargs}")
        fn = self.schedule.eval if eval_mode else self.schedule.step
        out = ctx.expect(fn, *args, losses=losses, **kw, **kwargs)
        for i, loss in enumerate(losses):
            ctx.tensor(f"loss {i}", loss)
        if isinstance(out, torch.Tensor):
            ctx.tensor("output", out)
        else:
            ctx.value("output", type(out).__name__)
        if not eval_mode:
            self.step_index += 1
        self.flags()
        return out

    def optim_step(self):
        self.ctx.optim_step(self.container, self.optim)


def _basic(ctx, sched, kind, steps=2, **kw):
    p = Pipeline(ctx, sched, kind, **kw)
    p.flags()
    for _ in range(steps):
        p.step()
        p.optim_step()


def _world(kind, pp=2):
    return pp if kind == "plain" else 2 * pp


NON_V = [s for s, (_, placement) in SCHEDULES.items() if placement != "v"]
# Stages that are plain containers of FSDP modules, on the schedules without
# split backward (zero-bubble schedules refuse them with a RuntimeError:
# test/distributed/pipelining/test_pipelining_fsdp_zero_bubble.py)
for _sched in ("gpipe", "1f1b", "interleaved_1f1b", "looped_bfs"):
    register(f"pp.{_sched}.container", functools.partial(_basic, sched=_sched, kind="container"),
             world=_world("container"), timeout=90)


for _sched in SCHEDULES:
    for _kind in KINDS:
        register(f"pp.{_sched}.{_kind}", functools.partial(_basic, sched=_sched, kind=_kind), world=_world(_kind),
                 timeout=90)

CORE = ("gpipe", "1f1b", "interleaved_1f1b", "zbv")
NON_V_CORE = ("gpipe", "1f1b", "interleaved_1f1b")
# FSDP stages only: with plain stages, 2.15.0's gradients for this loss differ
# from run to run (seen as NONDET on 2.15.0 for gpipe, 1f1b, interleaved_1f1b, zbv)
for _sched in CORE:
    for _kind in ("fsdp",):
        register(f"pp.{_sched}.{_kind}.loss_own_backward",
                 functools.partial(_basic, sched=_sched, kind=_kind, loss="own_backward"), world=_world(_kind))
for _sched in ("1f1b",):
    for _kind in KINDS:
        register(f"pp.{_sched}.{_kind}.scale_grads_False",
                 functools.partial(_basic, sched=_sched, kind=_kind, scale_grads=False), world=_world(_kind))


def _no_finalize(ctx, sched, kind, eval_between=False):
    p = Pipeline(ctx, sched, kind)
    for _ in range(2):
        p.step(finalize_gradients=False)
        if eval_between:
            p.step(eval_mode=True, data_step=50 + p.step_index)
        p.step()
        p.optim_step()


for _sched, _kind in ([(s, k) for s in CORE for k in ("plain", "fsdp")] + [("1f1b", "ddp")]
                      + [(s, "container") for s in NON_V_CORE]):
    register(f"pp.{_sched}.{_kind}.no_finalize_accumulation",
             functools.partial(_no_finalize, sched=_sched, kind=_kind), world=_world(_kind))
for _sched in NON_V_CORE:
    for _kind in ("plain", "fsdp", "container"):
        register(f"pp.{_sched}.{_kind}.no_finalize_eval_step",
                 functools.partial(_no_finalize, sched=_sched, kind=_kind, eval_between=True), world=_world(_kind))


def _train_eval_sequence(ctx, sched, kind):
    """step, step(finalize_gradients=False) + step, eval + step, step + eval,
    step, each followed by an optimizer step (the sequence of
    test/distributed/pipelining/test_pipelining_fsdp_container.py)."""
    p = Pipeline(ctx, sched, kind, scale_grads=False)
    p.step()
    p.optim_step()
    p.step(finalize_gradients=False)
    p.step()
    p.optim_step()
    p.step(eval_mode=True, data_step=70)
    p.step()
    p.optim_step()
    p.step()
    p.step(eval_mode=True, data_step=71)  # between a step and its optimizer step
    p.optim_step()
    p.step()
    p.optim_step()


# Stages that are plain containers of FSDP modules, on the schedules without
# split backward; scale_grads=False (a container stage is a plain stage for the
# schedule, whose gradients accumulate unscaled across finalize_gradients=False)
for _sched in ("gpipe", "1f1b", "interleaved_1f1b", "looped_bfs"):
    register(f"pp.{_sched}.container.train_eval_sequence",
             functools.partial(_train_eval_sequence, sched=_sched, kind="container"), world=_world("container"))


def _eval_around(ctx, sched, kind, **kw):
    p = Pipeline(ctx, sched, kind, **kw)
    p.step(eval_mode=True, data_step=60)  # before any training step
    p.step()
    p.optim_step()
    p.step(eval_mode=True, data_step=61)  # between steps
    p.step()
    p.optim_step()
    p.step(eval_mode=True, data_step=62)  # after training


# Not the V-shaped schedules (zbv, dualpipev): their eval() fails on 2.15.0
# ("can't steal_bwd_input if this stage doesn't have backward") and then hangs
# until the gloo timeout, on every torch.
for _sched in NON_V:
    for _kind in ("plain", "fsdp", "container"):
        register(f"pp.{_sched}.{_kind}.eval_before_between_after",
                 functools.partial(_eval_around, sched=_sched, kind=_kind), world=_world(_kind))


def _eval_autograd(ctx, sched):
    """eval() after a training step, on a model whose forward uses autograd itself."""
    p = Pipeline(ctx, sched, "plain", autograd_in_forward=True)
    p.step()
    p.optim_step()
    p.step(eval_mode=True, data_step=61)
    p.step()
    p.optim_step()


for _sched in ("gpipe", "1f1b", "interleaved_1f1b"):
    register(f"pp.{_sched}.plain.eval_autograd_in_forward", functools.partial(_eval_autograd, sched=_sched),
             world=2, gloo_timeout=4, timeout=30)


def _return_outputs(ctx, sched, kind):
    p = Pipeline(ctx, sched, kind)
    p.step(return_outputs=False)
    p.optim_step()
    p.step(return_outputs=True)
    p.optim_step()


for _sched in ("1f1b",):
    for _kind in ("plain", "fsdp"):
        register(f"pp.{_sched}.{_kind}.return_outputs",
                 functools.partial(_return_outputs, sched=_sched, kind=_kind), world=_world(_kind))


def _loss_keeps_layer_gathered(ctx, sched):
    """The loss keeps the last stage's layer gathered with set_reshard_after_forward(False)."""

    def hook(p):
        if not hook.done:
            hook.done = True
            p.module(p.num_stages - 1).layers[0].set_reshard_after_forward(False)

    hook.done = False
    p = Pipeline(ctx, sched, "fsdp", hooks={"loss": hook})
    for _ in range(3):
        p.step()
        p.optim_step()


for _sched in ("gpipe", "1f1b", "interleaved_1f1b"):
    register(f"pp.{_sched}.fsdp.loss_sets_reshard_after_forward", functools.partial(_loss_keeps_layer_gathered,
                                                                                    sched=_sched), world=4)


def _user_unshard(ctx, sched):
    p = Pipeline(ctx, sched, "fsdp")
    for mod in p.stage_mods.values():
        for sub in mod.modules():
            if isinstance(sub, FSDPModule):
                sub.unshard()
    p.flags()
    for _ in range(2):
        p.step()
        p.optim_step()


for _sched in CORE:
    register(f"pp.{_sched}.fsdp.user_unshard_before_first_step", functools.partial(_user_unshard, sched=_sched),
             world=4)


class Boom(Exception):
    pass


def _probe_failure_retry(ctx, sched, kind):
    """Stage 0's first forward (metadata inference, before any P2P) raises once; the step is retried."""
    p = Pipeline(ctx, sched, kind)
    if p.has_first:
        def fail_once(module, args):
            handle.remove()
            raise Boom("injected stage forward failure")

        handle = p.module(0).layers[0].register_forward_pre_hook(fail_once)
        p.step()
        p.step_index = 0
    p.step()
    p.optim_step()
    p.step()
    p.optim_step()


# On 2.15.0 the retry waits for peers that wait elsewhere: short timeouts
for _sched in ("1f1b",):
    for _kind in ("plain", "fsdp"):
        register(f"pp.{_sched}.{_kind}.first_forward_error_retry",
                 functools.partial(_probe_failure_retry, sched=_sched, kind=_kind), world=_world(_kind),
                 gloo_timeout=3, timeout=20)


def _single_stage_error_retry(ctx, sched, kind, where):
    """One stage per pipeline (pp=1, DP over the world): a failure at step 2 on every rank, then a retry."""

    def fail(p):
        if p.step_index == 1 and not fail.done:
            fail.done = True
            raise Boom(f"injected {where} failure")

    fail.done = False
    hooks = {"loss": fail} if where == "loss" else {}
    p = Pipeline(ctx, sched, kind, pp=1, hooks=hooks)
    p.step()
    p.optim_step()
    if where == "forward":
        def pre(module, args):
            if not pre.done:
                pre.done = True
                raise Boom("injected forward failure")

        pre.done = False
        p.module(0).layers[0].register_forward_pre_hook(pre)
    p.step()
    if where in ("forward", "loss"):
        p.step_index = 1
        p.step()
    p.optim_step()
    p.step()
    p.optim_step()


for _sched in ("1f1b",):
    for _kind in (*KINDS, "container"):
        for _where in ("forward", "loss"):
            register(f"pp1.{_sched}.{_kind}.{_where}_error_retry",
                     functools.partial(_single_stage_error_retry, sched=_sched, kind=_kind, where=_where), world=2)
