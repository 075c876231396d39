"""Pipelining scenarios: every 2.15.0 schedule class with plain, FSDP,
replicate() and DDP stages, and stages that are plain containers of FSDP
modules (only APIs torch 2.15.0 has)."""

import copy
import functools

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor
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
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, _Action, _ComputationType

from catalogue import register

VOCAB, DIM, SEQ = 16, 8, 4
MB_SIZE = 2
LR = 0.1
REF_TOL = 1e-4  # float32 pipeline vs float64 reference, absolute, over these tiny tensors

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


class ForwardsThenBackwards(PipelineScheduleMulti):
    """A custom schedule of one stage per rank, written as a ``pipeline_order`` that
    ``PipelineScheduleMulti`` runs itself (its own step loop, not the runtime's)."""

    def __init__(self, stages, n_microbatches, loss_fn, **kwargs):
        super().__init__(stages, n_microbatches, loss_fn=loss_fn, **kwargs)
        self.pipeline_order = {
            0: [_Action(0, _ComputationType.FORWARD, i) for i in range(n_microbatches)]
            + [_Action(0, _ComputationType.FULL_BACKWARD, i) for i in range(n_microbatches)]
        }


#: Custom schedules (pp=1 only), not part of the loops over SCHEDULES
CUSTOM_SCHEDULES = {"custom_multi": (ForwardsThenBackwards, "single")}


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
                 scale_grads: bool = True, autograd_in_forward: bool = False, hooks=None,
                 shared_layer: bool = False, reference: bool = True) -> None:
        self.ctx = ctx
        cls, placement = SCHEDULES[sched] if sched in SCHEDULES else CUSTOM_SCHEDULES[sched]
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
        # shared_layer: a rank's two loop stages (r and r + pp) run the same layer object
        self.plan = [[i % pp if shared_layer else i] for i in range(num_stages)]
        self.full = full
        self.scale_grads = scale_grads
        self.kind = kind
        # The float64 single-process reference: every rank's data, every stage's layers in order
        self.ref = (copy.deepcopy(full).double()
                    if reference and not autograd_in_forward and (pp > 1 or reference == "always") else None)
        self.refs = [self.ref] * (ctx.world // pp)
        if self.ref is not None and kind == "container":
            # A container stage's own parameters (embedding, norm) are not data parallel: each
            # data-parallel rank's copies train on its own data and drift apart; the sharded
            # blocks and the head are one set of parameters
            self.refs = []
            for _ in range(ctx.world // pp):
                r = copy.deepcopy(self.ref)
                r.layers, r.head = self.ref.layers, self.ref.head
                self.refs.append(r)
            self.ref = self.refs[self.dp_rank]
        head_in_forward = loss not in ("own_backward", "own_backward_in_eval")
        self.stage_mods = {}
        stages = []
        for idx in indices:
            first, last = idx == 0, idx == num_stages - 1
            mod = StageMod(full, self.plan[idx], first, last, head_in_forward)
            mod = self._wrap(mod, kind, last)
            self.stage_mods[idx] = mod
            stages.append(PipelineStage(mod, idx, num_stages, torch.device("cpu"), group=self.pp_group))
        self.stages = stages
        self.has_first = 0 in self.stage_mods
        self.has_last = num_stages - 1 in self.stage_mods
        self.container = nn.ModuleDict({str(i): m for i, m in self.stage_mods.items()})
        self.optim = torch.optim.SGD(self.container.parameters(), lr=LR)
        self.hooks = hooks or {}
        self.own_backward_in_eval_only = loss == "own_backward_in_eval"
        self.in_eval = False
        self.read_policies = not hooks  # a hook may change a policy with an old setter
        loss_fn = self._own_backward_loss if loss in ("own_backward", "own_backward_in_eval") else self._loss
        target = stages[0] if len(stages) == 1 and sched in SCHEDULES else stages
        self.schedule = cls(target, n_microbatches=n_mb, loss_fn=loss_fn, scale_grads=scale_grads)
        self.step_index = 0
        # The caller's no-sync is on (FSDP2's accumulation idiom): FSDP stages leave the step's
        # gradients unscaled (0026), the reference too
        self.caller_no_sync = False

    # ---- construction
    def _wrap(self, mod, kind, last):
        if kind in ("fsdp", "container"):
            for layer in mod.layers:
                if not isinstance(layer, FSDPModule):  # a layer shared with the rank's other stage
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
        if self.own_backward_in_eval_only and not self.in_eval:
            return _ce(last.head(last.norm(h)), target)
        if not torch.is_grad_enabled() or not h.requires_grad:
            return _ce(last.head(last.norm(h)), target)
        h_detached = h.detach().requires_grad_(True)
        loss = _ce(last.head(last.norm(h_detached)), target)
        loss.backward()
        surrogate = (h * h_detached.grad).sum()
        return surrogate - surrogate.detach() + loss.detach()

    # ---- data
    def data(self, step, dp_rank):
        gen = torch.Generator().manual_seed(100 * step + dp_rank)
        tokens = torch.randint(0, VOCAB, (self.n_mb * MB_SIZE, SEQ), generator=gen)
        labels = torch.randint(0, VOCAB, (self.n_mb * MB_SIZE, SEQ), generator=gen)
        return tokens, labels

    def inputs(self, step):
        tokens, labels = self.data(step, self.dp_rank)
        args = (tokens,) if self.has_first else ()
        kwargs = {"target": labels} if self.has_last else {}
        return args, kwargs

    # ---- running
    def flags(self):
        self.ctx.record("flags", [[s.stage_index, s.is_first, s.is_last, s.has_backward] for s in self.stages],
                       self.schedule.scale_grads, torch.is_grad_enabled())
        self.ctx.public_state(self.container)
        if self.read_policies:
            # What the old setters set (both torches) and, where the series' getter exists, the
            # caller's policy read back between steps (docs/parity.md)
            self.ctx.fsdp_state(f"after step {self.step_index}", self.container)

    def step(self, *, eval_mode=False, data_step=None, reference_step=True, record_output=True, **kwargs):
        ctx = self.ctx
        data_step = self.step_index if data_step is None else data_step
        args, kw = self.inputs(data_step)
        losses = []
        label = "eval" if eval_mode else "step"
        ctx.phase(f"{label} {data_step} {kwargs}")
        fn = self.schedule.eval if eval_mode else self.schedule.step
        self.in_eval = eval_mode
        out = ctx.expect(fn, *args, losses=losses, **kw, **kwargs)
        self.in_eval = False
        if not eval_mode and reference_step:  # a step that raises adds nothing to the reference
            self.ref_step(data_step, kwargs.get("finalize_gradients", True))
        for i, loss in enumerate(losses):
            ctx.tensor(f"loss {i}", loss)
        if isinstance(out, torch.Tensor):
            ctx.tensor("output", out)
        elif record_output:
            ctx.value("output", type(out).__name__)
        if not eval_mode:
            self.step_index += 1
        self.flags()
        return out

    def optim_step(self):
        if self.ref is not None:
            self.ref_check(f"grads before optimizer step {self.ctx.steps + 1}", grads=True)
        self.ctx.optim_step(self.container, self.optim)
        if self.ref is not None:
            with torch.no_grad():
                for p in self.ref_params():
                    if p.grad is not None:
                        p -= LR * p.grad
                    p.grad = None
            self.ref_check(f"parameters after optimizer step {self.ctx.steps}", grads=False)

    # ---- the float64 reference
    def ref_step(self, step, finalize):
        """What a correct training step adds to the gradients: every data-parallel rank's
        microbatches, averaged over the data-parallel ranks, scaled by 1/n_microbatches when
        scale_grads (2.15.0 scales whatever .grad holds on every step of a plain stage; FSDP and,
        with 0024, container stages on finalizing steps only)."""
        if self.ref is None:
            return
        dp = self.dp_mesh.size()
        for d in range(dp):
            ref = self.refs[d]
            named = list(ref.named_parameters())
            tokens, labels = self.data(step, d)
            loss = 0
            for xm, ym in zip(tokens.chunk(self.n_mb), labels.chunk(self.n_mb)):
                x = ref.embed(xm)
                for ids in self.plan:
                    for i in ids:
                        x = ref.layers[i](x)
                loss = loss + _ce(ref.head(ref.norm(x)), ym)
            grads = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)
            for (name, p), g in zip(named, grads):
                if g is None:
                    continue
                local = self.kind == "container" and name.split(".")[0] in ("embed", "norm")
                w = 1.0 if local else 1.0 / dp
                p.grad = w * g if p.grad is None else p.grad + w * g
        if self.scale_grads and (self.kind in ("plain", "ddp", "replicate") or (finalize and not self.caller_no_sync)):
            for p in self.ref_params():
                if p.grad is not None:
                    p.grad /= self.n_mb

    def ref_params(self):
        return list({id(p): p for r in self.refs for p in r.parameters()}.values())

    def ref_check(self, label, grads):
        """Records whether this rank's parameters (or gradients) equal the reference's."""
        ref_params = dict(self.ref.named_parameters())
        local = {id(p) for p in self.container.parameters()}
        mismatch = None
        with self.ctx.unrecorded():
            for name, p in self.full.named_parameters():
                if id(p) not in local:
                    continue
                t, r = (p.grad, ref_params[name].grad) if grads else (p, ref_params[name])
                if isinstance(t, DTensor):
                    t = t.full_tensor()
                if (t is None) != (r is None):
                    mismatch = mismatch or f"{name} is {'None' if t is None else 'set'}, reference not"
                    continue
                if t is not None and (t.detach().double() - r.detach()).abs().max().item() > REF_TOL:
                    mismatch = mismatch or f"{name} beyond {REF_TOL}"
        self.ctx.reference(label, mismatch)


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
# FSDP stage modules whose root holds parameters of its own (embed), on the
# schedules with one stage per rank (the others reshard the stage module after
# its evaluation forward already)
for _sched in ("gpipe", "1f1b"):
    register(f"pp.{_sched}.fsdp.train_eval_sequence",
             functools.partial(_train_eval_sequence, sched=_sched, kind="fsdp"), world=_world("fsdp"))


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
    p = Pipeline(ctx, sched, kind, reference=False)
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


def _single_stage_no_finalize(ctx, sched, kind):
    """One stage per pipeline (pp=1, DP over the world) on a custom PipelineScheduleMulti:
    step(finalize_gradients=False), step(), an optimizer step, twice, against the float64
    reference (a container stage's blocks stay pending and its gradients unscaled until the
    finalizing step, 0024, in PipelineScheduleMulti's own step loop too)."""
    p = Pipeline(ctx, sched, kind, pp=1, reference="always")
    for _ in range(2):
        p.step(finalize_gradients=False)
        p.step()
        p.optim_step()


register("pp1.custom_multi.container.no_finalize_accumulation",
         functools.partial(_single_stage_no_finalize, sched="custom_multi", kind="container"), world=2)

def _single_stage_late_loss_failure(ctx, sched, kind):
    """One stage per pipeline (pp=1, DP over the world): at step 2 the loss raises on every rank at
    the last microbatch, after the other microbatches' backward passes; the retry runs without
    zero_grad(). Compared with the float64 reference, which skips the failed step: a container
    stage's own parameters (embedding, norm) must not keep the failed step's partial gradients
    (0025), nor its blocks (0020)."""

    def fail(p):
        if p.step_index == 1 and not fail.done:
            fail.calls += 1
            if fail.calls == p.n_mb:
                fail.done = True
                raise Boom("injected loss failure at the last microbatch")

    fail.done, fail.calls = False, 0
    p = Pipeline(ctx, sched, kind, pp=1, hooks={"loss": fail}, reference="always")
    p.step()
    p.optim_step()
    p.step(reference_step=False)
    p.step_index = 1
    # 2.15.0's retry and every step after it raise (no output): only the series' outputs exist
    p.step(record_output=False)
    p.optim_step()
    p.step(record_output=False)
    p.optim_step()


register("pp1.1f1b.container.late_loss_error_retry",
         functools.partial(_single_stage_late_loss_failure, sched="1f1b", kind="container"), world=2)


def _shared_layer(ctx, sched, kind):
    """A layer shared by a rank's two loop stages (stages r and r + pp run the same module):
    train, eval() between a step and its optimizer step, train (issue 25 point 1's layout).
    scale_grads=False: with True, 2.15.0 divides the shared layer's gradient once per stage (a
    2.15.0 behaviour the series keeps, known.json)."""
    p = Pipeline(ctx, sched, kind, shared_layer=True, scale_grads=False)
    p.flags()
    p.step()
    p.optim_step()
    p.step()
    p.step(eval_mode=True, data_step=80)
    p.optim_step()
    p.step()
    p.optim_step()


# Plain stages only: two FSDP-root stages holding one fully_shard'ed layer hang on 2.15.0 and on the
# series alike (TIMEOUT), and a container stage's shared block has .grad None after eval() on both
# torches (reported in docs/parity.md; not a parity difference)
for _sched in ("interleaved_1f1b", "looped_bfs"):
    for _kind in ("plain",):
        register(f"pp.{_sched}.{_kind}.shared_layer", functools.partial(_shared_layer, sched=_sched, kind=_kind),
                 world=_world(_kind), timeout=30)


# A block shared by a rank's two loop stages with scale_grads=True: 2.15.0 divides its gradient once
# per stage (the first division before the other stage's backward passes added theirs); 0027
# divides it once, by the last of its stages to finish (api.md; allowlisted: numbers)
def _shared_layer_scaled(ctx, sched):
    """A layer shared by a rank's two loop stages, scale_grads=True: three steps, each followed by
    an optimizer step, against the float64 reference (the shared layer's gradient divided once)."""
    p = Pipeline(ctx, sched, "plain", shared_layer=True)
    p.flags()
    for _ in range(3):
        p.step()
        p.optim_step()


for _sched in ("interleaved_1f1b", "looped_bfs"):
    register(f"pp.{_sched}.plain.shared_layer.scale_grads", functools.partial(_shared_layer_scaled, sched=_sched),
             world=_world("plain"), timeout=30)


def _caller_no_sync(ctx, sched):
    """FSDP2's accumulation idiom on FSDP stages: two steps under the caller's
    set_requires_gradient_sync(False), then a syncing step and an optimizer step, twice. 2.15.0
    reduces and scales every step (the earlier steps' gradients divided again); 0026 leaves the
    no-sync steps' gradients pending and unscaled, so the syncing step gives the sum of the steps'
    means (the float64 reference)."""
    p = Pipeline(ctx, sched, "fsdp")
    fsdp_modules = [m for mod in p.stage_mods.values() for m in mod.modules() if isinstance(m, FSDPModule)]
    p.flags()
    for _ in range(2):
        for module in fsdp_modules:
            module.set_requires_gradient_sync(False)
        ctx.policy_changed()
        p.caller_no_sync = True
        p.step()
        p.step()
        for module in fsdp_modules:
            module.set_requires_gradient_sync(True)
        ctx.policy_changed()
        p.caller_no_sync = False
        p.step()
        p.optim_step()


for _sched in NON_V_CORE:
    register(f"pp.{_sched}.fsdp.caller_no_sync", functools.partial(_caller_no_sync, sched=_sched),
             world=_world("fsdp"))


def _grad_eval_own_backward_no_sync(ctx, sched):
    """A container stage whose blocks do not sync (set_requires_gradient_sync(False)) runs eval()
    in grad mode with a loss that runs its own backward (the head's gradients accumulate, unreduced);
    then the blocks sync again, the gradients are zeroed and training goes on."""
    # Training steps apply the head inside the loss without a backward of their own: with a
    # container stage, a loss that runs its own backward in every step gives gradients that
    # differ from run to run on 2.15.0 (NONDET), as for plain stages
    p = Pipeline(ctx, sched, "container", loss="own_backward_in_eval")
    blocks = [m for mod in p.stage_mods.values() for m in mod.modules() if isinstance(m, FSDPModule)]
    p.step()
    p.optim_step()
    for block in blocks:
        block.set_requires_gradient_sync(False)
    ctx.policy_changed()
    p.step(eval_mode=True, data_step=90)
    for block in blocks:
        block.set_requires_gradient_sync(True)
    ctx.policy_changed()
    p.optim.zero_grad()
    for q in p.ref_params() if p.ref is not None else ():
        q.grad = None
    p.flags()
    for _ in range(2):
        p.step()
        p.optim_step()


for _sched in ("gpipe", "1f1b"):
    register(f"pp.{_sched}.container.grad_eval_own_backward_no_sync",
             functools.partial(_grad_eval_own_backward_no_sync, sched=_sched), world=4)
