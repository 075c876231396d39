"""FSDP2 / replicate() / DDP scenarios (only APIs torch 2.15.0 has)."""

import functools

import numpy
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    fully_shard,
    register_fsdp_forward_method,
)
from torch.utils.checkpoint import checkpoint

from catalogue import register

VOCAB, DIM, SEQ, BATCH = 16, 8, 4, 4
LR = 0.1


class Block(nn.Module):
    def __init__(self, ckpt: str = "") -> None:
        super().__init__()
        self.lin1 = nn.Linear(DIM, 2 * DIM)
        self.lin2 = nn.Linear(2 * DIM, DIM)
        self.ckpt = ckpt

    def _body(self, x):
        return x + self.lin2(torch.tanh(self.lin1(x)))

    def forward(self, x):
        if self.ckpt == "reentrant":
            return checkpoint(self._body, x, use_reentrant=True)
        if self.ckpt == "non_reentrant":
            return checkpoint(self._body, x, use_reentrant=False)
        return self._body(x)


class Net(nn.Module):
    """embed -> blocks -> norm -> head; ``tied`` shares embed and head weights."""

    def __init__(self, n: int = 3, tied: bool = False, ckpt: str = "", reuse: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([Block(ckpt) for _ in range(n)])
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        if tied:
            self.head.weight = self.embed.weight
        self.reuse = reuse

    def features(self, tokens):
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        if self.reuse:  # the first block runs twice (a shared module)
            h = self.blocks[0](h)
        return h

    def forward(self, tokens):
        return self.head(self.norm(self.features(tokens)))


def batch(ctx, step: int):
    gen = torch.Generator().manual_seed(100 * step + ctx.rank)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    return tokens, labels


def lm_loss(logits, labels):
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def fsdp_net(ctx, *, head="separate", rafs=True, n=3, mesh=None, mp=None, offload=None,
             ckpt="", reuse=False, ignored=False, root_rafs=None):
    torch.manual_seed(0)
    model = Net(n, tied=head == "tied", ckpt=ckpt, reuse=reuse)
    kw = {"mesh": mesh}
    if mp is not None:
        kw["mp_policy"] = mp
    if offload is not None:
        kw["offload_policy"] = offload
    if ignored:
        kw_root = dict(kw, ignored_params={model.norm.weight, model.norm.bias})
    else:
        kw_root = kw
    for block in model.blocks:
        fully_shard(block, reshard_after_forward=rafs, **kw)
    if head == "grouped":
        fully_shard([model.norm, model.head], reshard_after_forward=rafs, **kw)
    elif head == "separate":
        fully_shard(model.head, reshard_after_forward=rafs, **kw)
    if root_rafs is None:
        fully_shard(model, **kw_root)
    else:
        fully_shard(model, reshard_after_forward=root_rafs, **kw_root)
    return model


def train(ctx, model, optim, steps=2, start=0, forward=None, between=None, loss_fn=lm_loss):
    forward = forward or model
    for step in range(start, start + steps):
        tokens, labels = batch(ctx, step)
        ctx.phase(f"forward {step}")
        loss = loss_fn(forward(tokens), labels)
        ctx.tensor("loss", loss)
        ctx.phase(f"backward {step}")
        loss.backward()
        ctx.optim_step(model, optim)
        ctx.public_state(model)
        if between is not None:
            between(step)


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=LR)


# ---------------------------------------------------------------- basics
def _basic(ctx, head, rafs, world_mesh=None, **kw):
    model = fsdp_net(ctx, head=head, rafs=rafs, **kw)
    ctx.public_state(model)
    train(ctx, model, sgd(model))


for _head in ("separate", "grouped", "tied", "root"):
    for _rafs in (True, False):
        register(f"fsdp.per_block.{_head}.rafs_{_rafs}", functools.partial(_basic, head=_head, rafs=_rafs))
    register(f"fsdp.per_block.{_head}.rafs_int2", functools.partial(_basic, head=_head, rafs=2), world=4)
register("fsdp.per_block.root_rafs_true", functools.partial(_basic, head="separate", rafs=True, root_rafs=True))
register("fsdp.per_block.one_block", functools.partial(_basic, head="root", rafs=True, n=1))
register("fsdp.per_block.world4", functools.partial(_basic, head="separate", rafs=True), world=4)

_MP = {
    "bf16": MixedPrecisionPolicy(param_dtype=torch.bfloat16),
    "bf16_reduce_fp32": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
    "bf16_out_fp32": MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=torch.float32),
    "bf16_no_cast_inputs": MixedPrecisionPolicy(param_dtype=torch.bfloat16, cast_forward_inputs=False),
}
for _name, _mp in _MP.items():
    register(f"fsdp.mixed_precision.{_name}", functools.partial(_basic, head="separate", rafs=True, mp=_mp))
register("fsdp.cpu_offload", functools.partial(_basic, head="separate", rafs=True,
                                               offload=CPUOffloadPolicy(pin_memory=False)))
register("fsdp.cpu_offload.rafs_False", functools.partial(_basic, head="grouped", rafs=False,
                                                          offload=CPUOffloadPolicy(pin_memory=False)))
register("fsdp.ignored_params", functools.partial(_basic, head="root", rafs=True, ignored=True))
register("fsdp.shared_module_reused", functools.partial(_basic, head="separate", rafs=True, reuse=True))
register("fsdp.shared_module_reused.rafs_False", functools.partial(_basic, head="separate", rafs=False, reuse=True))
for _kind in ("reentrant", "non_reentrant"):
    register(f"fsdp.checkpoint.{_kind}", functools.partial(_basic, head="separate", rafs=True, ckpt=_kind))
    register(f"fsdp.checkpoint.{_kind}.rafs_False",
             functools.partial(_basic, head="grouped", rafs=False, ckpt=_kind))


def _frozen(ctx):
    model = fsdp_net(ctx)
    model.blocks[0].requires_grad_(False)
    train(ctx, model, sgd(model))


register("fsdp.frozen_block", _frozen)


def _adam(ctx):
    model = fsdp_net(ctx, head="grouped")
    train(ctx, model, torch.optim.AdamW(model.parameters(), lr=0.01))


register("fsdp.adamw", _adam)


def _composable_checkpoint(ctx):
    from torch.distributed._composable import checkpoint as ckpt_api

    torch.manual_seed(0)
    model = Net(3)
    for block in model.blocks:
        ckpt_api(block)
        fully_shard(block)
    fully_shard(model)
    train(ctx, model, sgd(model))


register("fsdp.checkpoint.composable", _composable_checkpoint)


def _compile(ctx, rafs=True):
    torch.manual_seed(0)
    model = Net(2)
    for block in model.blocks:
        fully_shard(block, reshard_after_forward=rafs)
        block.compile(backend="aot_eager")
    fully_shard(model)
    train(ctx, model, sgd(model), steps=2)


register("fsdp.compile_per_block.aot_eager", _compile, timeout=240, gloo_timeout=120)


# ---------------------------------------------------------------- forward methods, prefetch, by hand
def _forward_method(ctx):
    model = fsdp_net(ctx, head="root")
    register_fsdp_forward_method(model, "features")
    optim = sgd(model)
    train(ctx, model, optim, forward=model.features, loss_fn=lambda h, y: h.pow(2).mean())
    train(ctx, model, optim, start=3, steps=1)


register("fsdp.register_fsdp_forward_method", _forward_method)


def _prefetch(ctx, fwd=True, bwd=True, depth=1, rafs=True):
    model = fsdp_net(ctx, head="separate", rafs=rafs, n=4)
    units = [*model.blocks, model.head]
    for i, unit in enumerate(units):
        if fwd:
            unit.set_modules_to_forward_prefetch(units[i + 1:i + 1 + depth])
        if bwd:
            unit.set_modules_to_backward_prefetch(list(reversed(units[max(0, i - depth):i])))
    train(ctx, model, sgd(model))


register("fsdp.prefetch.forward", functools.partial(_prefetch, bwd=False))
register("fsdp.prefetch.backward", functools.partial(_prefetch, fwd=False))
register("fsdp.prefetch.both_depth2", functools.partial(_prefetch, depth=2))
register("fsdp.prefetch.empty_lists", functools.partial(_prefetch, depth=0))


def _unshard_async(ctx, async_op=True, wait=True):
    model = fsdp_net(ctx, head="separate")
    optim = sgd(model)

    def before(step):
        handle = model.blocks[0].unshard(async_op=async_op)
        ctx.value("handle", type(handle).__name__)
        if handle is not None and wait:
            handle.wait()
        ctx.public_state(model)

    before(-1)
    train(ctx, model, optim, between=before)


register("fsdp.unshard.async_wait", _unshard_async)
register("fsdp.unshard.async_no_wait", functools.partial(_unshard_async, wait=False))
register("fsdp.unshard.sync", functools.partial(_unshard_async, async_op=False))


def _manual_reshard(ctx, rafs=False):
    model = fsdp_net(ctx, head="grouped", rafs=rafs)
    optim = sgd(model)
    for step in range(3):
        tokens, labels = batch(ctx, step)
        model.unshard()
        ctx.public_state(model)
        loss = lm_loss(model(tokens), labels)
        ctx.public_state(model)
        loss.backward()
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
        ctx.public_state(model)
        ctx.optim_step(model, optim)


register("fsdp.manual_unshard_reshard.rafs_False", _manual_reshard)
register("fsdp.manual_unshard_reshard.rafs_True", functools.partial(_manual_reshard, rafs=True))


def _reshard_after_forward_no_backward(ctx):
    model = fsdp_net(ctx, head="separate", rafs=False)
    tokens, _ = batch(ctx, 0)
    with torch.no_grad():
        ctx.tensor("out", model(tokens))
    ctx.public_state(model)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
    ctx.public_state(model)
    train(ctx, model, sgd(model), steps=2)


register("fsdp.rafs_False.nograd_then_reshard", _reshard_after_forward_no_backward)


# ---------------------------------------------------------------- setters
VALUES = {
    "True": True, "False": False, "np_True": numpy.bool_(True), "np_False": numpy.bool_(False),
    "int0": 0, "int1": 1, "None": None,
}
RECURSE_SETTERS = ["set_requires_gradient_sync", "set_requires_all_reduce", "set_reshard_after_forward",
                   "set_reshard_after_backward", "set_keep_unsharded_storage"]
DEFAULTS = {
    "set_requires_gradient_sync": True, "set_requires_all_reduce": True, "set_reshard_after_forward": True,
    "set_reshard_after_backward": True, "set_keep_unsharded_storage": False, "set_is_last_backward": True,
    "set_unshard_in_backward": True, "set_force_sum_reduction_for_comms": False,
}
PLAIN_SETTERS = ["set_is_last_backward", "set_unshard_in_backward", "set_force_sum_reduction_for_comms"]


class Body(nn.Module):
    """A root without parameters of its own: ``body`` holds the blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(Block(), Block(), Block())

    def forward(self, x):
        return self.body(x)


def seq_fsdp(ctx, mesh=None):
    torch.manual_seed(0)
    model = Body()
    for block in model.body:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def train_dense(ctx, model, optim, steps, start=0, finish=True):
    for step in range(start, start + steps):
        gen = torch.Generator().manual_seed(7 * step + ctx.rank)
        x = torch.randn(BATCH, DIM, generator=gen)
        ctx.phase(f"forward {step}")
        loss = model(x).pow(2).mean()
        ctx.tensor("loss", loss)
        loss.backward()
        ctx.public_state(model)
        if finish:
            ctx.optim_step(model, optim)


def _setter(ctx, setter, value, recurse_values, target, hsdp=False):
    """The setter with ``value`` (each ``recurse`` in turn), two backwards under it, then the default."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("r", "s")) if hsdp else None
    model = seq_fsdp(ctx, mesh)
    optim = sgd(model)
    train_dense(ctx, model, optim, 1)
    module = model if target == "root" else model.body[1]
    step = 1
    for recurse in recurse_values:
        kwargs = {} if recurse is None else {"recurse": recurse}
        ctx.phase(f"{setter}({value!r}, {kwargs})")
        ctx.expect(getattr(module, setter), value, **kwargs)
        ctx.public_state(model)
        # Two backwards under the setting (accumulating when it stops a reduction)
        train_dense(ctx, model, optim, 2, start=step, finish=False)
        step += 2
        ctx.grads(model)
        ctx.phase("back to the default")
        ctx.expect(getattr(model, setter), DEFAULTS[setter], **({} if setter in PLAIN_SETTERS else {"recurse": True}))
        for sub in model.modules():
            if isinstance(sub, FSDPModule):
                sub.reshard()
        train_dense(ctx, model, optim, 1, start=step)
        step += 1


for _setter_name in RECURSE_SETTERS:
    for _vname, _v in VALUES.items():
        register(f"fsdp.setter.{_setter_name}.{_vname}",
                 functools.partial(_setter, setter=_setter_name, value=_v, recurse_values=(False, True),
                                   target="root"))
    register(f"fsdp.setter.{_setter_name}.False.body1",
             functools.partial(_setter, setter=_setter_name, value=False, recurse_values=(None,), target="body1"))
for _setter_name in PLAIN_SETTERS:
    for _vname, _v in VALUES.items():
        register(f"fsdp.setter.{_setter_name}.{_vname}",
                 functools.partial(_setter, setter=_setter_name, value=_v, recurse_values=(None,), target="root"))
for _setter_name in ("set_requires_all_reduce", "set_requires_gradient_sync"):
    register(f"fsdp.setter.hsdp.{_setter_name}.np_False",
             functools.partial(_setter, setter=_setter_name, value=VALUES["np_False"], recurse_values=(True,),
                               target="root", hsdp=True), world=4)


def _divide_factor(ctx, method, factor):
    model = seq_fsdp(ctx)
    ctx.expect(getattr(model, method), factor)
    train_dense(ctx, model, sgd(model), 2)


register("fsdp.setter.set_gradient_divide_factor.4", functools.partial(_divide_factor, method="set_gradient_divide_factor", factor=4.0))
register("fsdp.setter.set_gradient_divide_factor.1", functools.partial(_divide_factor, method="set_gradient_divide_factor", factor=1.0))
register("fsdp.setter.set_reduce_scatter_divide_factor.2", functools.partial(_divide_factor, method="set_reduce_scatter_divide_factor", factor=2.0))


# ---------------------------------------------------------------- accumulation, eval, errors
def _accumulate(ctx, sync, microbatches=2, last_backward=False):
    model = fsdp_net(ctx, head="grouped")
    optim = sgd(model)
    for step in range(3):
        for mb in range(microbatches):
            last = mb == microbatches - 1
            if not sync:
                model.set_requires_gradient_sync(last)
            if last_backward:
                model.set_is_last_backward(last)
            tokens, labels = batch(ctx, 10 * step + mb)
            loss = lm_loss(model(tokens), labels) / microbatches
            ctx.tensor("loss", loss)
            loss.backward()
            ctx.public_state(model)
        ctx.optim_step(model, optim)


register("fsdp.grad_accum.with_sync", functools.partial(_accumulate, sync=True))
register("fsdp.grad_accum.no_sync", functools.partial(_accumulate, sync=False))
register("fsdp.grad_accum.no_sync.3mb", functools.partial(_accumulate, sync=False, microbatches=3))
register("fsdp.grad_accum.is_last_backward", functools.partial(_accumulate, sync=True, last_backward=True))
register("fsdp.grad_accum.no_sync.is_last_backward",
         functools.partial(_accumulate, sync=False, last_backward=True))


def _two_forwards_one_backward(ctx):
    model = fsdp_net(ctx, head="separate")
    optim = sgd(model)
    for step in range(3):
        t1, l1 = batch(ctx, step)
        t2, l2 = batch(ctx, step + 50)
        loss = lm_loss(model(t1), l1) + lm_loss(model(t2), l2)
        loss.backward()
        ctx.optim_step(model, optim)


register("fsdp.two_forwards_one_backward", _two_forwards_one_backward)


def _eval_between(ctx, mode, rafs=True, head="separate"):
    model = fsdp_net(ctx, head=head, rafs=rafs)

    def evaluate(step):
        tokens, _ = batch(ctx, 90 + step)
        ctx.phase(f"eval {mode}")
        if mode == "no_grad":
            with torch.no_grad():
                ctx.tensor("eval out", model(tokens))
        elif mode == "inference_mode":
            with torch.inference_mode():
                ctx.tensor("eval out", model(tokens))
        elif mode == "eval_no_grad":
            model.eval()
            with torch.no_grad():
                ctx.tensor("eval out", model(tokens))
            model.train()
        elif mode == "grad_no_backward":
            ctx.tensor("eval out", model(tokens))
        ctx.public_state(model)

    train(ctx, model, sgd(model), steps=3, between=evaluate)


for _mode in ("no_grad", "inference_mode", "eval_no_grad", "grad_no_backward"):
    register(f"fsdp.eval_between_steps.{_mode}", functools.partial(_eval_between, mode=_mode))
register("fsdp.eval_between_steps.no_grad.rafs_False", functools.partial(_eval_between, mode="no_grad", rafs=False))
register("fsdp.eval_between_steps.no_grad.grouped", functools.partial(_eval_between, mode="no_grad", head="grouped"))


class Boom(Exception):
    pass


def _error_recovery(ctx, where, reset=False):
    model = fsdp_net(ctx, head="separate")
    optim = sgd(model)
    train(ctx, model, optim, steps=1)
    tokens, labels = batch(ctx, 1)
    if where == "forward":
        def hook(module, args):
            handle.remove()
            raise Boom("injected forward failure")

        handle = model.blocks[1].register_forward_pre_hook(hook)
        ctx.expect(lambda: lm_loss(model(tokens), labels).backward())
    else:
        def grad_hook(grad):
            raise Boom("injected backward failure")

        logits = model(tokens)
        logits.register_hook(grad_hook)
        ctx.expect(lambda: lm_loss(logits, labels).backward())
    ctx.public_state(model)
    optim.zero_grad()
    if reset:
        ctx.expect(model.reset_iter_state)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
    train(ctx, model, optim, steps=2, start=2)


register("fsdp.error_recovery.forward", functools.partial(_error_recovery, where="forward"))
register("fsdp.error_recovery.backward", functools.partial(_error_recovery, where="backward"))
register("fsdp.error_recovery.forward.reset_iter_state",
         functools.partial(_error_recovery, where="forward", reset=True))
register("fsdp.error_recovery.backward.reset_iter_state",
         functools.partial(_error_recovery, where="backward", reset=True))


def _manual_finalization(ctx, microbatches):
    model = fsdp_net(ctx, head="separate")
    optim = sgd(model)
    ctx.expect(model.set_manual_backward_finalization, True)
    for step in range(2):
        for mb in range(microbatches):
            tokens, labels = batch(ctx, 10 * step + mb)
            (lm_loss(model(tokens), labels) / microbatches).backward()
        ctx.expect(model.finalize_backward)
        ctx.optim_step(model, optim)


register("fsdp.manual_backward_finalization.1mb", functools.partial(_manual_finalization, microbatches=1))
register("fsdp.manual_backward_finalization.2mb", functools.partial(_manual_finalization, microbatches=2))


def _api_errors(ctx):
    model = fsdp_net(ctx, head="separate")
    ctx.expect(model.set_reshard_after_forward, "yes")
    ctx.expect(model.set_reduce_scatter_max_input_buffers, 0)
    ctx.expect(model.blocks[0].finalize_backward)
    ctx.expect(model.blocks[1].set_manual_backward_finalization, True)
    train(ctx, model, sgd(model), steps=1)


register("fsdp.api_errors", _api_errors)


def _reshard_after_forward_values(ctx):
    """``reshard_after_forward`` values on a 1-D mesh of 4 (fully_shard and the setter): 3 and 0
    raise, 1 and 4 are normalized, 2 reshards to pairs; then a root given
    ``set_reshard_after_forward(True)`` before its first forward, which lazy initialization keeps
    (its all-gathers show it)."""
    for value in (3, 0, 5, "2", 1, 4, 2):
        ctx.phase(f"fully_shard(reshard_after_forward={value!r})")
        ctx.expect(lambda v=value: fully_shard(nn.Linear(DIM, DIM), reshard_after_forward=v) and None)
    model = fsdp_net(ctx, head="separate")
    for value in (3, 2):
        ctx.phase(f"set_reshard_after_forward({value!r})")
        ctx.expect(model.set_reshard_after_forward, value)
        ctx.public_state(model)
    train(ctx, model, sgd(model), steps=1)
    model = fsdp_net(ctx, head="separate")
    ctx.phase("root set_reshard_after_forward(True) before the first forward")
    ctx.expect(model.set_reshard_after_forward, True, recurse=False)
    train(ctx, model, sgd(model), steps=2)


register("fsdp.reshard_after_forward.values", _reshard_after_forward_values, world=4)


# ---------------------------------------------------------------- HSDP, replicate(), DDP
def _hsdp(ctx, head="separate", rafs=True, accumulate=False):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = fsdp_net(ctx, head=head, rafs=rafs, mesh=mesh)
    optim = sgd(model)
    if not accumulate:
        train(ctx, model, optim)
        return
    for step in range(2):
        for mb in range(2):
            model.set_requires_all_reduce(mb == 1)
            tokens, labels = batch(ctx, 10 * step + mb)
            lm_loss(model(tokens), labels).backward()
        ctx.optim_step(model, optim)


register("hsdp.basic", _hsdp, world=4)
register("hsdp.grouped.rafs_False", functools.partial(_hsdp, head="grouped", rafs=False), world=4)
register("hsdp.rafs_int2", functools.partial(_hsdp, rafs=2), world=4)
register("hsdp.accumulate_without_all_reduce", functools.partial(_hsdp, accumulate=True), world=4)


def _replicate(ctx, per_block=True, accumulate=False, eval_no_grad=False):
    from torch.distributed._composable.replicate_with_fsdp import replicate

    torch.manual_seed(0)
    model = Net(3)
    if per_block:
        for block in model.blocks:
            replicate(block)
    replicate(model)
    optim = sgd(model)
    if accumulate:
        for step in range(2):
            for mb in range(2):
                model.set_requires_gradient_sync(mb == 1)
                tokens, labels = batch(ctx, 10 * step + mb)
                lm_loss(model(tokens), labels).backward()
            ctx.optim_step(model, optim)
        return

    def evaluate(step):
        if eval_no_grad:
            with torch.no_grad():
                ctx.tensor("eval", model(batch(ctx, 70 + step)[0]))

    train(ctx, model, optim, between=evaluate)


register("replicate.per_block", _replicate)
register("replicate.root_only", functools.partial(_replicate, per_block=False))
register("replicate.accumulate_no_sync", functools.partial(_replicate, accumulate=True))
register("replicate.eval_no_grad_between", functools.partial(_replicate, eval_no_grad=True))


def _replicate_setters(ctx):
    from torch.distributed._composable.replicate_with_fsdp import replicate

    torch.manual_seed(0)
    model = Net(2)
    for block in model.blocks:
        replicate(block)
    replicate(model)
    for name, value in (("set_requires_gradient_sync", numpy.bool_(False)), ("set_requires_gradient_sync", 1),
                        ("set_reshard_after_backward", False), ("set_reshard_after_backward", True),
                        ("set_reshard_after_forward", False), ("set_reshard_after_forward", True)):
        ctx.phase(f"{name}({value!r})")
        ctx.expect(getattr(model, name), value)
    train(ctx, model, sgd(model), steps=2)


register("replicate.setters", _replicate_setters)


def _ddp(ctx, accumulate=False, static=False):
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(Net(3), static_graph=static)
    optim = sgd(model)
    if accumulate:
        for step in range(2):
            for mb in range(2):
                tokens, labels = batch(ctx, 10 * step + mb)
                if mb == 0:
                    with model.no_sync():
                        lm_loss(model(tokens), labels).backward()
                else:
                    lm_loss(model(tokens), labels).backward()
            ctx.optim_step(model, optim)
        return
    train(ctx, model, optim)


register("ddp.basic", _ddp)
register("ddp.no_sync_accumulation", functools.partial(_ddp, accumulate=True))
register("ddp.static_graph", functools.partial(_ddp, static=True))


class DenseLM(nn.Module):
    """A root holding only the input projection, two blocks and a separately sharded head."""

    def __init__(self, reentrant: bool = False) -> None:
        super().__init__()
        self.embed = nn.Linear(DIM, DIM)
        self.body = nn.ModuleList([nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh()) for _ in range(2)])
        self.lm_head = nn.Linear(DIM, DIM)
        self.reentrant = reentrant

    def forward(self, x):
        x = self.embed(x)
        for block in self.body:
            if self.reentrant and torch.is_grad_enabled():
                x = checkpoint(block, x, use_reentrant=True)
            else:
                x = block(x)
        return self.lm_head(x)


def _eval_before_each_step(ctx, mode, reentrant=False):
    torch.manual_seed(0)
    model = DenseLM(reentrant)
    for block in model.body:
        fully_shard(block)
    fully_shard(model.lm_head)
    fully_shard(model)
    optim = sgd(model)
    for step in range(3):
        gen = torch.Generator().manual_seed(7 * step + ctx.rank)
        x = torch.randn(BATCH, DIM, generator=gen)
        ctx.phase(f"eval {mode} {step}")
        if mode == "no_grad":
            with torch.no_grad():
                ctx.tensor("eval out", model(x))
        else:
            with torch.inference_mode():
                ctx.tensor("eval out", model(x))
        ctx.phase(f"forward {step}")
        loss = model(x).square().mean()
        ctx.phase(f"backward {step}")
        loss.backward()
        ctx.optim_step(model, optim)


register("fsdp.eval_before_each_step.no_grad", functools.partial(_eval_before_each_step, mode="no_grad"))
register("fsdp.eval_before_each_step.no_grad.reentrant_checkpoint",
         functools.partial(_eval_before_each_step, mode="no_grad", reentrant=True))
register("fsdp.eval_before_each_step.inference_mode",
         functools.partial(_eval_before_each_step, mode="inference_mode"))


def _eval_variant(ctx, variant):
    torch.manual_seed(0)
    model = DenseLM()
    rafs = variant != "rafs_False"
    for block in model.body:
        fully_shard(block, reshard_after_forward=rafs)
    fully_shard(model.lm_head, reshard_after_forward=rafs)
    fully_shard(model)
    optim = sgd(model)
    for step in range(3):
        gen = torch.Generator().manual_seed(7 * step + ctx.rank)
        x = torch.randn(BATCH, DIM, generator=gen)
        ctx.phase(f"forward {step}")
        loss = model(x).square().mean()
        ctx.phase(f"backward {step}")
        loss.backward()
        ctx.optim_step(model, optim)
        ctx.phase(f"eval {variant} {step}")
        with torch.no_grad():
            if variant == "twice":
                model(x)
                model(x)
            elif variant == "submodule":
                model.body[0](x)
            elif variant == "head_only":
                model.lm_head(x)
            else:
                model(x)


for _variant in ("twice", "submodule", "head_only", "rafs_False"):
    register(f"fsdp.eval_between_steps.dense.{_variant}", functools.partial(_eval_variant, variant=_variant))
