"""Runtime of generated FSDP programs (tools/parity/generate.py): a tiny decoder,
its unsharded reference and the checks of oracle B. Generated programs and the
standalone scripts written from them use this file's text verbatim."""
import collections
import copy
import dataclasses
import logging

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed._composable.replicate_with_fsdp import replicate  # noqa: F401 - used by programs
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard  # noqa: F401
try:  # oracle a runs on pristine 2.15.0 too, which has no FSDPPolicy
    from torch.distributed.fsdp import FSDPPolicy
except ImportError:
    FSDPPolicy = None
from torch.distributed.fsdp._fully_shard import _fsdp_param_group
from torch.distributed.tensor import DTensor

V, D, S, B = 32, 16, 8, 2  # vocabulary, width, sequence length, microbatch size
LR, TOL = 0.1, 1e-4


class InjectedError(Exception):
    """What a loss, a forward or a chunk's backward that the program makes fail raises."""


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.fail = False  # raise InjectedError in the next forward (then reset)

    def forward(self, x):
        if self.fail:
            self.fail = False
            raise InjectedError("injected in a block's forward")
        return x + torch.tanh(self.lin(x))


class Net(nn.Module):
    def __init__(self, norm_in_forward, aux):
        super().__init__()
        self.tok_embeddings = nn.Embedding(V, D)
        self.layers = nn.ModuleList([Block(), Block()])
        self.norm = nn.LayerNorm(D)
        self.lm_head = nn.Linear(D, V, bias=False)
        self.mtp = nn.Linear(D, V, bias=False) if aux else None  # an auxiliary head
        self.norm_in_forward = norm_in_forward

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.norm(h) if self.norm_in_forward else h

    def head(self, h):
        return self.lm_head(h if self.norm_in_forward else self.norm(h))

    def aux(self, h):
        return self.mtp(h)


def make_net(norm_in_forward=True, aux=False, tied=False, frozen_embed=False):
    """``(model, ref)``: the model to shard and its unsharded copy."""
    torch.manual_seed(0)
    net = Net(norm_in_forward, aux)
    if tied:
        net.lm_head.weight = net.tok_embeddings.weight
    if frozen_embed:
        net.tok_embeddings.weight.requires_grad_(False)
    return net, copy.deepcopy(net)


def data(step, rank, mb):
    gen = torch.Generator().manual_seed(1000 * step + 10 * rank + mb)
    return torch.randint(0, V, (B, S), generator=gen), torch.randint(0, V, (B, S), generator=gen)


def ce(logits, labels, n_mb):
    """Summed over tokens, divided by the step's token count: chunks add up."""
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum") / (B * S * n_mb)


def full_loss(m, tokens, labels, n_mb, finish=False, fail=False, fail_in="loss"):
    """One microbatch without chunking; ``fail``: the loss raises ``InjectedError`` instead of
    running the backward (``fail_in="forward"``: ``layers[1]``'s forward raises it)."""
    if fail and fail_in == "forward":
        m.layers[1].fail = True
    h = m(tokens)
    logits = m.head(h)
    loss = ce(scope_of(m).finish_forward(logits) if finish else logits, labels, n_mb)
    if m.mtp is not None:
        loss = loss + ce(m.aux(h), labels.roll(1, 1), n_mb)
    if fail:
        raise InjectedError("injected in the loss")
    loss.backward()


def scope_of(m):
    """The module a chunked loss enters ``partial_backward`` on: the head's group, else the root."""
    return m.lm_head if isinstance(m.lm_head, FSDPModule) else m


def _raise_injected(*_):
    raise InjectedError("injected in a chunk's backward")


def chunked_loss(m, tokens, labels, n_mb, n_chunks, drop=False, metric=False, fail_bwd=False, fail_head=False):
    """One microbatch of the chunked loss: one ``partial_backward`` scope per head. ``drop``: the
    chunk losses are computed and no backward runs (a loss guard drops the microbatch; the decoder
    backward is skipped too); ``metric``: a grad-enabled call of the head outside the scope whose
    output is detached (a last-position metric); ``fail_bwd``: chunk 1's backward raises
    ``InjectedError`` after the head's backward ran; ``fail_head``: it raises after chunk 1's head
    forward, inside the scope, before ``finish_forward``."""
    h = m(tokens)
    chunks = [c.detach().requires_grad_(h.requires_grad) for c in h.chunk(n_chunks, 1)]
    if metric:
        scope_of(m).finish_forward(m.head(h[:, -1:])).detach()
    heads = [(scope_of(m), m.head, labels)]
    if m.mtp is not None:
        heads.append((m.mtp, m.aux, labels.roll(1, 1)))
    for scope, head, target in heads:
        with scope.partial_backward(outer_backward=h.requires_grad):
            for j, (c, t) in enumerate(zip(chunks, target.chunk(n_chunks, 1))):
                out = head(c)
                if fail_head and j == 1:
                    raise InjectedError("injected after a chunk's head forward")
                loss = ce(scope.finish_forward(out), t, n_mb)
                if drop:
                    continue
                if fail_bwd and j == 1:
                    c.register_hook(_raise_injected)
                loss.backward()
    if h.requires_grad and not drop:
        h.backward(torch.cat([c.grad for c in chunks], 1))


def after_failed_chunk_backward(ctx, m, reset):
    """After an exception inside a chunk's backward (or its head forward, in the scope):
    ``reset_iter_state()`` on the root, the
    documented recovery. Without it first (``reset=False``) the next scope entry must refuse with
    an error that says to call ``reset_iter_state()`` on the root (api.md section 8); then the
    program resets."""
    if not reset:
        try:
            with scope_of(m).partial_backward(outer_backward=True):
                pass
            ctx.check("refusal names reset_iter_state()", False,
                      "a scope was entered after a failed chunk backward without reset_iter_state()")
        except Exception as exc:  # noqa: BLE001 - the refusal under test
            ctx.check("refusal names reset_iter_state()", "reset_iter_state" in str(exc),
                      f"{type(exc).__name__}: {str(exc)[:160]}")
    m.reset_iter_state()


def eval_chunk_loop(ctx, m, tokens, n_chunks):
    """A ``torch.no_grad()`` evaluation chunk loop inside the head's ``partial_backward`` scope."""
    with torch.no_grad():
        h = m(tokens)
        scope = scope_of(m)
        with scope.partial_backward(outer_backward=False):
            for c in h.chunk(n_chunks, 1):
                ctx.tensor("eval", scope.finish_forward(m.head(c)))


def ref_train(ref, step, world, n_mb, skip=None):
    """The reference's gradients for one optimizer step of every rank's data (without microbatch
    ``skip`` or the microbatches of a tuple ``skip``: failed on every rank, or dropped)."""
    skip = skip if isinstance(skip, tuple) else (skip,)
    for rank in range(world):
        for mb in range(n_mb):
            if mb in skip:
                continue
            t, y = data(step, rank, mb)
            h = ref(t)
            loss = ce(ref.head(h), y, n_mb)
            if ref.mtp is not None:
                loss = loss + ce(ref.aux(h), y.roll(1, 1), n_mb)
            (loss / world).backward()


def fsdp_modules(m):
    return [x for x in m.modules() if isinstance(x, FSDPModule)]


def groups(m):
    return [g for x in fsdp_modules(m) for g in x._get_fsdp_state()._fsdp_param_groups]


def head_groups(m):
    """The groups of the head's own FSDP state (where the chunked loss enters its scope)."""
    scope = scope_of(m)
    return [] if scope is m else list(scope._get_fsdp_state()._fsdp_param_groups)


def reshard_body(m):
    """``reshard()`` of every FSDP module but the head's state: what 2.15.0 asks after a forward
    without a backward (the root keeps its parameters), without touching what a scope left."""
    scope = scope_of(m)
    head = None if scope is m else scope._get_fsdp_state()
    for x in fsdp_modules(m):
        if x._get_fsdp_state() is not head:
            x.reshard()


def unsharded_bytes(group_list):
    """Bytes of unsharded parameter storage the groups hold."""
    total = 0
    for g in group_list:
        for fp in g.fsdp_params:
            t = getattr(fp, "_unsharded_param", None)
            if t is not None:
                total += t.untyped_storage().nbytes()
    return total


class Reductions:
    """Counts ``foreach_reduce`` calls (one reduction of one group) by group, named by its first
    parameter (``count``), and those that also all-reduce across replicas (``all_reduces``: HSDP,
    ``replicate()``); a group tied across both ends of the model (``tok_embeddings``) is not counted
    there: 2.15.0 reduces it once or twice per backward depending on the layout. ``calls`` counts
    every call (the tied group's too) and ``logged`` the debug lines ``FSDP::post_backward_reduce``
    of the ``torch.distributed.fsdp.fully_shard`` logger (0023: one per reduction)."""

    def __init__(self, m, tied):
        self.count, self.all_reduces = collections.Counter(), collections.Counter()
        self.calls = self.logged = 0
        orig = _fsdp_param_group.foreach_reduce

        def counting(fsdp_params, *args, **kwargs):
            group = next(g for g in groups(m) if any(fp is fsdp_params[0] for fp in g.fsdp_params))
            name = group.fsdp_params[0]._param_fqn
            self.calls += 1
            if not (tied and name.startswith("tok_embeddings")):
                self.count[name] += 1
                # foreach_reduce(fsdp_params, grads, rs group, rs stream, rs comm, reduce dtype,
                # device, divide factor, all-reduce group, all-reduce stream, all_reduce_grads, ...)
                if args[7] is not None and args[9]:
                    self.all_reduces[name] += 1
            return orig(fsdp_params, *args, **kwargs)

        _fsdp_param_group.foreach_reduce = counting
        reductions = self

        class _Lines(logging.Handler):
            def emit(self, record):
                if str(record.msg) == "%s" and str(record.args[0]).startswith("FSDP::post_backward_reduce"):
                    reductions.logged += 1

        log = logging.getLogger("torch.distributed.fsdp.fully_shard")
        log.setLevel(logging.DEBUG)  # the worker's own handler (on "torch") records WARNING and up only
        log.addHandler(_Lines(logging.DEBUG))

    def clear(self):
        self.count.clear()
        self.all_reduces.clear()
        self.calls = self.logged = 0


def policies(m):
    return [x.get_fsdp_policy() for x in fsdp_modules(m)]


#: Invalid policy field values: the value type refuses the first three and 0 (``TypeError``,
#: ``ValueError``); 3 is a valid ``FSDPPolicy`` but no divisor of any program's shard mesh size,
#: which ``set_fsdp_policy`` and the scope refuse (``ValueError``).
BAD_POLICY_FIELDS = [("requires_gradient_sync", 1), ("requires_all_reduce", None),
                     ("reshard_after_backward", "no"), ("reshard_after_forward", 0),
                     ("reshard_after_forward", 3)]


def refuses_bad_policies(ctx, m, label):
    """Each of ``BAD_POLICY_FIELDS`` is refused with ``TypeError`` or ``ValueError`` by the value
    type (except 3), by ``set_fsdp_policy`` and by the ``fsdp_policy`` scope, and no module's
    policy changes (api.md: bad input raises before anything is changed)."""
    before = policies(m)
    for field, value in BAD_POLICY_FIELDS:
        def scope():
            with m.fsdp_policy(**{field: value}, recurse=True):
                pass
        calls = [("set_fsdp_policy", lambda: m.set_fsdp_policy(
            dataclasses.replace(m.get_fsdp_policy(), **{field: value}), recurse=True)), ("fsdp_policy", scope)]
        if value != 3:
            calls.append(("FSDPPolicy", lambda: FSDPPolicy(**{field: value})))
        for how, call in calls:
            try:
                call()
                raised = None
            except (TypeError, ValueError) as exc:
                raised = exc
            ctx.check("bad policy refused", raised is not None, f"{label}: {how}({field}={value!r}) was accepted")
    ctx.check("bad policy refused", policies(m) == before, f"{label}: a refused policy changed {before} to {policies(m)}")


def pending_everywhere(m):
    """FSDP modules with trainable parameters whose ``has_pending_gradients()`` is False."""
    return [type(x).__name__ for x in fsdp_modules(m)
            if any(p.requires_grad for p in x.parameters()) and not x.has_pending_gradients()]


def pending_anywhere(m):
    """FSDP modules whose ``has_pending_gradients()`` (either ``recurse``) is True."""
    return [f"{type(x).__name__}(recurse={r})" for x in fsdp_modules(m) for r in (True, False)
            if x.has_pending_gradients(recurse=r)]


def open_forwards(m):
    """FSDP modules whose group still waits for some of its modules' forwards (a grouped forward
    that neither completed nor was finished by ``finish_forward``)."""
    return [type(x).__name__ for x in fsdp_modules(m) if x._get_fsdp_state()._modules_to_run_forward]


def failed_lazy_init(ctx, m):
    """A first forward whose lazy initialization raises (manual finalization set on a module that is
    not the root: "must be called on the root"), ``reset_iter_state()`` (0012: a no-op returning the
    root to idle), the cause fixed: the program then trains as if it had not happened."""
    sub = next(x for x in fsdp_modules(m) if x is not m)
    sub.set_manual_backward_finalization(True)
    try:
        m(data(0, 0, 0)[0])
        ctx.check("lazy init refused", False, "a forward with manual finalization on a non-root module ran")
    except RuntimeError as exc:
        ctx.check("lazy init refused", "root" in str(exc), f"{type(exc).__name__}: {str(exc)[:160]}")
    m.reset_iter_state()
    sub.set_manual_backward_finalization(False)


def unreduced_grad_bytes(group_list):
    """Bytes of unsharded gradients that the groups whose policy reduces now still hold."""
    total = 0
    for g in group_list:
        if not g.reduce_grads:
            continue
        for fp in g.fsdp_params:
            grad = getattr(getattr(fp, "_unsharded_param", None), "grad", None)
            if grad is not None:
                total += grad.untyped_storage().nbytes()
    return total


def hold_probe(m, held, head_groups, unreduced=None):
    """Records the head groups' unsharded bytes when the decoder backward reaches layers[0] and,
    with ``unreduced``, the unreduced gradient bytes of those whose policy reduces then."""
    def sample(g):
        held.append(unsharded_bytes(head_groups()))
        if unreduced is not None:
            unreduced.append(unreduced_grad_bytes(head_groups()))

    def hook(module, args, out):
        if out.requires_grad:
            out.register_hook(sample)
    m.layers[0].register_forward_hook(hook)


def check_grads(ctx, opt, ref, label, rel=0.0):
    """The optimizer's (sharded) parameters against the reference's, in construction order, within
    ``TOL`` plus ``rel`` times the reference gradient's largest magnitude (mixed precision)."""
    for (name, rp), p in zip(ref.named_parameters(), opt.param_groups[0]["params"]):
        g = p.grad
        if isinstance(g, DTensor):
            g = g.full_tensor()
        if g is None or rp.grad is None:
            ctx.check("grad present", (g is None) == (rp.grad is None), f"{label} {name}: {g is None} vs ref {rp.grad is None}")
            continue
        err = (g - rp.grad).abs().max().item()
        ctx.check("grad matches reference", err <= TOL + rel * rp.grad.abs().max().item(), f"{label} {name}: max |grad - ref| {err:.2e}")


def drop_post_forward_order(m, start):
    """What 0013 does when a forward-only iteration ends: drop the post-forward order entries from
    ``start`` on (oracle A runs this on pristine 2.15.0 to confirm that a difference is 0013's)."""
    order = m._get_fsdp_state()._comm_ctx.post_forward_order
    del order[start:]
    for g in groups(m):
        while g._post_forward_indices and g._post_forward_indices[-1] >= start:
            g._post_forward_indices.pop()


def optim_step(ctx, m, ref, opt, ref_opt, label, rel=0.0):
    check_grads(ctx, opt, ref, label, rel)
    ctx.grads(m)
    opt.step()
    ref_opt.step()
    ctx.params(m)
    opt.zero_grad()
    ref_opt.zero_grad()
