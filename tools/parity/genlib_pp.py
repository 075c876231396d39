"""Runtime of generated pipelining programs (tools/parity/generate.py): a tiny
model cut into stages, its unsharded reference and the checks of oracle B.
Generated programs and the standalone scripts written from them use this
file's text verbatim."""
import contextlib
import copy
import datetime
import time

import torch
import torch.distributed as dist
import torch.distributed.pipelining as pipelining
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

V, D, S, MB = 16, 8, 4, 2  # vocabulary, width, sequence length, microbatch size
LR, TOL = 0.1, 1e-4
# A program with a one-rank failure runs with a gloo timeout of FAIL_TIMEOUT_S (generator.gloo_timeout);
# a call after the failure that takes FAST_S or longer waited for it ("slow"; 2.15.0: 0.1 s or the timeout)
FAIL_TIMEOUT_S, FAST_S = 4.0, 2.0


class InjectedError(Exception):
    """What a loss or a stage forward that the program makes fail raises (on one rank only)."""


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x):
        return x + torch.tanh(self.lin(x))


class Full(nn.Module):
    def __init__(self, n_stages, shared):
        super().__init__()
        self.embed = nn.Embedding(V, D)
        layers = [Layer() for _ in range(n_stages)]
        if shared == "layers":  # stage i and i + n/2 (one rank's loop stages) share a layer
            layers[n_stages // 2:] = layers[:n_stages // 2]
        self.layers = nn.ModuleList(layers)
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, V, bias=False)
        if shared == "tied":
            self.head.weight = self.embed.weight

    def forward(self, x):
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))

    def tail(self, x):
        """The last stage's part of ``forward`` only (its input detached): what a loss that runs
        its own backward inside ``eval()`` reaches."""
        with torch.no_grad():
            x = self.embed(x)
            for layer in self.layers[:-1]:
                x = layer(x)
        return self.head(self.norm(self.layers[-1](x)))


class Stage(nn.Module):
    def __init__(self, full, i, n):
        super().__init__()
        self.embed = full.embed if i == 0 else None
        self.layers = nn.ModuleList([full.layers[i]])
        self.norm = full.norm if i == n - 1 else None
        self.head = full.head if i == n - 1 else None
        self.fail_at = None  # raise InjectedError at this forward call (counted from 0), then reset
        self.calls = 0
        self.before_fail = None  # called just before that raise

    def forward(self, x):
        if self.fail_at is not None:
            self.calls += 1
            if self.calls - 1 == self.fail_at:
                self.fail_at = None
                if self.before_fail is not None:
                    self.before_fail()
                raise InjectedError("injected in a stage forward (one rank only)")
        if self.embed is not None:
            x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x)) if self.head is not None else x


def loss_fn(logits, target):
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


@contextlib.contextmanager
def _unrecorded(ctx):
    """The parity worker records no collective inside (its recorder skips nested calls): which P2P
    operations a rank posts after a one-rank failure before it sees the error depends on timing."""
    depth = getattr(getattr(ctx, "recorder", None), "_depth", None)
    if depth is None:  # a standalone script's context
        yield
        return
    before = getattr(depth, "n", 0)
    depth.n = before + 1
    try:
        yield
    finally:
        depth.n = before


class Pipe:
    """This rank's stages of one pipeline, an optimizer and the reference.

    ``shared``: ``"layers"`` (a layer shared by a rank's two loop stages) or ``"tied"`` (the
    embedding tied to the head of a V rank); ``caller_raf``: the caller's
    ``set_reshard_after_forward(False)`` on every FSDP block; ``policy_check`` (oracle B): every
    ``get_fsdp_policy()`` after a step equals the one before (the caller's)."""

    def __init__(self, ctx, rank, world, schedule, placement, kind, shared="none", n_mb=4, scale_grads=True,
                 caller_raf=True, policy_check=False):
        self.ctx, self.n_mb, self.scale_grads, self.kind = ctx, n_mb, scale_grads, kind
        self.rank, self.policy_check = rank, policy_check
        self.loss_backward, self.loss_calls, self.loss_fail_at = False, 0, None
        self.nosync = False  # the caller's no-sync is on (the old setter or a scope)
        pp = 2
        mesh = init_device_mesh("cpu", (pp, world // pp), mesh_dim_names=("pp", "dp"))
        self.dp, self.dp_rank = world // pp, mesh["dp"].get_local_rank()
        r = mesh["pp"].get_local_rank()
        n = pp if placement == "single" else 2 * pp
        idx = {"single": [r], "loop": [r, r + pp], "v": sorted([r, 2 * pp - 1 - r])}[placement]
        self.idx, self.n_stages = idx, n
        torch.manual_seed(0)
        full = Full(n, shared)
        self.ref = copy.deepcopy(full)
        ref_names = {id(p): name for name, p in full.named_parameters()}
        stages = []
        self.mods = [Stage(full, i, n) for i in idx]  # named before any sharding replaces a shared parameter
        self.names = [{k: ref_names[id(p)] for k, p in mod.named_parameters(remove_duplicate=False)} for mod in self.mods]
        for i, mod in zip(idx, self.mods):
            # A layer shared by two local stages is sharded once (the second stage finds it sharded)
            if kind == "fsdp":  # blocks and head sharded, the stage module is the FSDP root
                for sub in [*mod.layers, mod.head]:
                    if sub is not None and not isinstance(sub, FSDPModule):
                        fully_shard(sub, mesh=mesh["dp"])
                fully_shard(mod, mesh=mesh["dp"])
            elif kind == "container":  # every child sharded, the stage module a plain container
                for sub in [mod.embed, *mod.layers, mod.norm, mod.head]:
                    if sub is not None and not isinstance(sub, FSDPModule):
                        fully_shard(sub, mesh=mesh["dp"], reshard_after_forward=True)
            stages.append(pipelining.PipelineStage(mod, i, n, torch.device("cpu"), group=mesh["pp"].get_group()))
        if not caller_raf:
            for mod in self.mods:
                for layer in mod.layers:
                    layer.set_reshard_after_forward(False)
        self.first, self.last = 0 in idx, n - 1 in idx
        self.model = nn.ModuleList(self.mods)
        # (reference name, sharded parameter): what the optimizer steps, whatever a forward left registered
        self.params = [(names[k], p) for mod, names in zip(self.mods, self.names)
                       for k, p in mod.named_parameters(remove_duplicate=False)]
        self.opt = torch.optim.SGD(list({id(p): p for _, p in self.params}.values()), lr=LR)
        self.ref_opt = torch.optim.SGD(self.ref.parameters(), lr=LR)
        cls = getattr(pipelining, schedule)
        self.schedule = cls(stages[0] if len(stages) == 1 else stages, n_microbatches=n_mb, loss_fn=self.loss,
                            scale_grads=scale_grads)

    def loss(self, logits, target):
        """``loss_fn`` of the schedule: raises ``InjectedError`` at call ``loss_fail_at`` of a step;
        with ``loss_backward`` (set by ``eval(loss_backward=True)``) it runs its own backward."""
        self.loss_calls += 1
        if self.loss_fail_at is not None and self.loss_calls - 1 == self.loss_fail_at:
            self.loss_fail_at = None
            raise InjectedError("injected in the loss (one rank only)")
        loss = loss_fn(logits, target)
        if self.loss_backward and loss.requires_grad:
            loss.backward()
        return loss

    def fsdp_modules(self):
        return [x for mod in self.mods for x in mod.modules() if isinstance(x, FSDPModule)]

    def policies(self):
        return [x.get_fsdp_policy() for x in self.fsdp_modules()]

    def batch(self, step, dp_rank):
        gen = torch.Generator().manual_seed(100 * step + dp_rank)
        return (torch.randint(0, V, (self.n_mb * MB, S), generator=gen),
                torch.randint(0, V, (self.n_mb * MB, S), generator=gen))

    def run(self, step, eval_mode=False, loss_backward=False, ref=True, **kwargs):
        """One ``step()`` (or ``eval()``) of data ``step``; the reference trains on the same data.
        ``loss_backward``: the loss runs its own backward (``eval()`` in grad mode: the last stage's
        parameters get its gradients, unscaled; the reference does the same)."""
        x, y = self.batch(step, self.dp_rank)
        args = (x,) if self.first else ()
        kw = {"target": y} if self.last else {}
        losses = []
        self.ctx.phase(f"{'eval' if eval_mode else 'step'} {step} {kwargs}")
        before = self.policies() if self.policy_check else None
        self.loss_calls, self.loss_backward = 0, loss_backward
        try:
            (self.schedule.eval if eval_mode else self.schedule.step)(*args, losses=losses, **kw, **kwargs)
        finally:
            self.loss_backward = False
            if before is not None:
                self.ctx.check("policy between steps == caller's", self.policies() == before,
                               f"{'eval' if eval_mode else 'step'} {step}: {self.policies()} vs {before}")
        for loss in losses:
            self.ctx.tensor("loss", loss)
        if not ref:
            return
        if eval_mode:
            # Under the caller's no-sync an FSDP or container stage's eval() leaves its gradients
            # pending, and its exit drops them (api.md section 6): nothing reaches .grad
            if loss_backward and torch.is_grad_enabled() and not (self.nosync and self.kind != "plain"):
                for d in range(self.dp):
                    xs, ys = self.batch(step, d)
                    for xm, ym in zip(xs.chunk(self.n_mb), ys.chunk(self.n_mb)):
                        (loss_fn(self.ref.tail(xm), ym) / self.dp).backward()
            return
        for d in range(self.dp):
            xs, ys = self.batch(step, d)
            for xm, ym in zip(xs.chunk(self.n_mb), ys.chunk(self.n_mb)):
                (loss_fn(self.ref(xm), ym) / self.dp).backward()
        # 2.15.0 scales whatever .grad holds, every step (FSDP root stages, and container stages
        # with 0024: finalizing steps only); a caller's no-sync leaves the accumulation unscaled and
        # the step that syncs scales it once (api.md section 8: the sum of the steps' means)
        if self.scale_grads and (self.kind == "plain" or (kwargs.get("finalize_gradients", True) and not self.nosync)):
            for p in self.ref.parameters():
                if p.grad is not None:
                    p.grad /= self.n_mb

    # ---- the caller's no-sync across steps (FSDP2's accumulation idiom) ----
    def set_sync(self, sync):
        """The old setter on every FSDP module of the stages (no-op for plain stages)."""
        for x in self.fsdp_modules():
            x.set_requires_gradient_sync(sync, recurse=False)
        self.nosync = not sync

    @contextlib.contextmanager
    def no_sync_scope(self):
        """``fsdp_policy(requires_gradient_sync=False)`` around the steps, on every FSDP module."""
        with contextlib.ExitStack() as stack:
            for x in self.fsdp_modules():
                stack.enter_context(x.fsdp_policy(requires_gradient_sync=False, recurse=False))
            self.nosync = True
            try:
                yield
            finally:
                self.nosync = False

    # ---- a step that fails on every rank ----
    def fail_every_rank(self, step):
        """Step ``step`` with stage 0's forward raising at microbatch 1 and the last stage's at
        microbatch 0 (one stage per rank: GPipe, 1F1B), so that every rank raises after stage 0's
        first send completed (the peer received it; the step had not waited on it). Then, on
        every rank, ``acknowledge_failed_step(all_ranks_failed=True)``, ``zero_grad()`` and the
        retry of the step, which must run like a clean step (the reference trains it once):
        completed sends are not "in flight" (0021). Stage 0 raises only once the last stage of
        its pipeline raised (the store, not gloo), so its send has been received by then: a send
        still unreceived when a rank raises is in flight, and the series refuses the retry."""
        store = dist.distributed_c10d._get_default_store()
        key = f"fail-every-rank-{step}-{self.dp_rank}"
        for i, mod in zip(self.idx, self.mods):
            mod.fail_at, mod.calls = (1 if i == 0 else 0), 0
            if i == 0:
                mod.before_fail = lambda: store.wait([key], datetime.timedelta(seconds=3 * FAIL_TIMEOUT_S))
            else:
                mod.before_fail = lambda: store.set(key, "1")
        try:
            self.run(step, ref=False)
            raised = None
        except Exception as exc:  # noqa: BLE001 - the failure under test
            raised = exc
        finally:
            for mod in self.mods:
                mod.fail_at, mod.before_fail = None, None
        injected = raised
        while injected is not None and not isinstance(injected, InjectedError):
            injected = injected.__cause__ or injected.__context__
        self.ctx.check("every-rank failure raised", injected is not None, f"step {step}: {raised!r}"[:200])
        self.schedule.acknowledge_failed_step(all_ranks_failed=True)
        self.zero_grad()
        self.run(step)

    # ---- a step that fails on one rank only ----
    def _timed(self, label, fn):
        """Calls ``fn``; records its outcome and whether it ended within ``FAST_S`` (the hang
        detector: a peer waiting for the process-group timeout is "slow"); returns the outcome."""
        t0 = time.monotonic()
        try:
            fn()
            outcome = "ok"
        except Exception as exc:  # noqa: BLE001 - the failure under test and what follows from it
            outcome, cause = type(exc).__name__, exc
            while cause is not None:  # a stage wraps its forward's exception in a RuntimeError
                if isinstance(cause, InjectedError):
                    outcome = "InjectedError"
                cause = cause.__cause__ or cause.__context__
        took = time.monotonic() - t0
        # An observation, compared with 2.15.0 by oracle a (2.15.0 itself waits for the timeout in
        # some schedules, e.g. LoopedBFS with plain stages, so oracle b does not judge it)
        self.ctx.value(label, [outcome, "fast" if took < FAST_S else "slow"])
        return outcome

    def fail_one_rank(self, step, where, stage, mb, after):
        """Step ``step`` with the loss (``where="loss"``, on the last stage's rank) or the forward of
        stage ``stage`` (``where="forward"``) raising at microbatch ``mb`` on that rank only. The
        failed rank then retries the step (``after="retry"``), goes on with the next batch
        (``"skip"``) or ends (``"exit"``: its process exits); a loop whose retry or next step
        raised gives up (the process exits), one whose call succeeded goes on and stays alive until
        the healthy ranks are done (the store, not gloo). A healthy rank whose step completes goes
        on with the next batch, as a training loop does. Each call records its outcome and whether it ended
        within ``FAST_S`` (oracle a compares that with 2.15.0, whose healthy peer raises "Connection
        closed by peer" within 0.1 s in most layouts); a retry on the failed rank must raise (issue
        34 point 4: it cannot know whether its peers failed the same step). Ends the program: the
        process group is broken afterwards."""
        failing = (self.n_stages - 1 if where == "loss" else stage) in self.idx
        if failing and where == "loss":
            self.loss_fail_at = mb
        elif failing:
            mod = self.mods[self.idx.index(stage)]
            mod.fail_at, mod.calls = mb, 0

        def call(s):
            return lambda: self.run(s, ref=False)

        with _unrecorded(self.ctx):
            self._fail_one_rank(step, where, failing, after, call)

    def _fail_one_rank(self, step, where, failing, after, call):
        store = dist.distributed_c10d._get_default_store()
        first = self._timed("failed step", call(step))
        self.loss_fail_at = None
        for mod in self.mods:
            mod.fail_at = None
        if failing:
            self.ctx.check("injected failure raised", first == "InjectedError", f"step {step}: {first}")
            out = None
            if after == "retry":
                self.zero_grad()
                out = self._timed("retry", call(step))
                self.ctx.check("one-rank failure: retry refused", out != "ok",
                               f"the failed rank's retry of step {step} ran (its peers did not fail the same step)")
            elif after == "skip":
                self.zero_grad()
                out = self._timed("next step", call(step + 1))
            if out == "ok":  # the loop goes on: stay alive until the healthy ranks are done
                try:
                    store.wait([f"healthy-done-{r}" for r in range(dist.get_world_size()) if r != self.rank],
                               datetime.timedelta(seconds=3 * FAIL_TIMEOUT_S + 2))
                except Exception:  # noqa: BLE001 - a healthy rank that never finished: its checks say why
                    pass
        else:
            if first == "ok":
                self._timed("next step", call(step + 1))
            store.set(f"healthy-done-{self.rank}", "1")

    def check_grads(self, label):
        for name, p in self.params:
            g, rg = p.grad, self.ref.get_parameter(name).grad
            g = g.full_tensor() if isinstance(g, DTensor) else g
            if g is None or rg is None:
                self.ctx.check("grad present", (g is None) == (rg is None), f"{label} {name}: {g is None} vs ref {rg is None}")
                continue
            err = (g - rg).abs().max().item()
            self.ctx.check("grad matches reference", err <= TOL, f"{label} {name}: max |grad - ref| {err:.2e}")

    def optim_step(self, label):
        self.check_grads(label)
        self.ctx.grads(self.model)
        self.opt.step()
        self.ref_opt.step()
        self.ctx.params(self.model)
        self.zero_grad()

    def zero_grad(self):
        self.opt.zero_grad()
        self.ref_opt.zero_grad()

    def check_idle(self, label, evaluation=False):
        """After a finalizing step: no pending FSDP gradients, no unsharded parameter storage.

        ``evaluation``: after an ``eval()`` whose loss ran its own backward, only the last
        stage's modules ran a backward; the other stages' forward-only FSDP roots (and modules
        with ``reshard_after_forward=False``) keep their parameters unsharded as FSDP leaves
        them after any forward without backward (2.15.0 alike, the same bytes after an
        ``eval()`` under ``no_grad``; the next step all-gathers again), so only pending
        gradients are checked there (gen.b.229, 338, 413, 426, 436 of revision 5's first
        500-seed run; docs/parity.md)."""
        for i, mod in zip(self.idx, self.mods):
            check_held = not evaluation or i == self.n_stages - 1
            for sub in mod.modules():
                if not isinstance(sub, FSDPModule):
                    continue
                for g in sub._get_fsdp_state()._fsdp_param_groups:
                    self.ctx.check("no pending gradients", not g._post_backward_pending, f"{label} {sub.__class__.__name__}")
                    if not check_held:
                        continue
                    held = sum(fp._unsharded_param.untyped_storage().nbytes() for fp in g.fsdp_params
                               if getattr(fp, "_unsharded_param", None) is not None)
                    self.ctx.check("resharded", held == 0, f"{label}: {held} B unsharded")
