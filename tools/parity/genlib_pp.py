"""Runtime of generated pipelining programs (tools/parity/generate.py): a tiny
model cut into stages, its unsharded reference and the checks of oracle B.
Generated programs and the standalone scripts written from them use this
file's text verbatim."""
import copy

import torch
import torch.distributed.pipelining as pipelining
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

V, D, S, MB = 16, 8, 4, 2  # vocabulary, width, sequence length, microbatch size
LR, TOL = 0.1, 1e-4


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


class Stage(nn.Module):
    def __init__(self, full, i, n):
        super().__init__()
        self.embed = full.embed if i == 0 else None
        self.layers = nn.ModuleList([full.layers[i]])
        self.norm = full.norm if i == n - 1 else None
        self.head = full.head if i == n - 1 else None

    def forward(self, x):
        if self.embed is not None:
            x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x)) if self.head is not None else x


def loss_fn(logits, target):
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


class Pipe:
    """This rank's stages of one pipeline, an optimizer and the reference."""

    def __init__(self, ctx, rank, world, schedule, placement, kind, shared="none", n_mb=4, scale_grads=True):
        self.ctx, self.n_mb, self.scale_grads, self.kind = ctx, n_mb, scale_grads, kind
        pp = 2
        mesh = init_device_mesh("cpu", (pp, world // pp), mesh_dim_names=("pp", "dp"))
        self.dp, self.dp_rank = world // pp, mesh["dp"].get_local_rank()
        r = mesh["pp"].get_local_rank()
        n = pp if placement == "single" else 2 * pp
        idx = {"single": [r], "loop": [r, r + pp], "v": sorted([r, 2 * pp - 1 - r])}[placement]
        torch.manual_seed(0)
        full = Full(n, shared)
        self.ref = copy.deepcopy(full)
        ref_names = {id(p): name for name, p in full.named_parameters()}
        self.mods, self.names, stages = [], [], []
        for i in idx:
            mod = Stage(full, i, n)
            self.names.append({k: ref_names[id(p)] for k, p in mod.named_parameters(remove_duplicate=False)})
            if kind == "fsdp":  # blocks and head sharded, the stage module is the FSDP root
                for sub in [*mod.layers, mod.head]:
                    if sub is not None:
                        fully_shard(sub, mesh=mesh["dp"])
                fully_shard(mod, mesh=mesh["dp"])
            elif kind == "container":  # every child sharded, the stage module a plain container
                for sub in [mod.embed, *mod.layers, mod.norm, mod.head]:
                    if sub is not None:
                        fully_shard(sub, mesh=mesh["dp"], reshard_after_forward=True)
            self.mods.append(mod)
            stages.append(pipelining.PipelineStage(mod, i, n, torch.device("cpu"), group=mesh["pp"].get_group()))
        self.first, self.last = 0 in idx, n - 1 in idx
        self.model = nn.ModuleList(self.mods)
        # (reference name, sharded parameter): what the optimizer steps, whatever a forward left registered
        self.params = [(names[k], p) for mod, names in zip(self.mods, self.names)
                       for k, p in mod.named_parameters(remove_duplicate=False)]
        self.opt = torch.optim.SGD(list({id(p): p for _, p in self.params}.values()), lr=LR)
        self.ref_opt = torch.optim.SGD(self.ref.parameters(), lr=LR)
        cls = getattr(pipelining, schedule)
        self.schedule = cls(stages[0] if len(stages) == 1 else stages, n_microbatches=n_mb, loss_fn=loss_fn,
                            scale_grads=scale_grads)

    def batch(self, step, dp_rank):
        gen = torch.Generator().manual_seed(100 * step + dp_rank)
        return (torch.randint(0, V, (self.n_mb * MB, S), generator=gen),
                torch.randint(0, V, (self.n_mb * MB, S), generator=gen))

    def run(self, step, eval_mode=False, **kwargs):
        """One ``step()`` (or ``eval()``) of data ``step``; the reference trains on the same data."""
        x, y = self.batch(step, self.dp_rank)
        args = (x,) if self.first else ()
        kw = {"target": y} if self.last else {}
        losses = []
        self.ctx.phase(f"{'eval' if eval_mode else 'step'} {step} {kwargs}")
        (self.schedule.eval if eval_mode else self.schedule.step)(*args, losses=losses, **kw, **kwargs)
        for loss in losses:
            self.ctx.tensor("loss", loss)
        if not eval_mode:
            for d in range(self.dp):
                xs, ys = self.batch(step, d)
                for xm, ym in zip(xs.chunk(self.n_mb), ys.chunk(self.n_mb)):
                    (loss_fn(self.ref(xm), ym) / self.dp).backward()
            # 2.15.0 scales whatever .grad holds, every step (FSDP root stages, and container stages
            # with 0024: finalizing steps only)
            if self.scale_grads and (self.kind == "plain" or kwargs.get("finalize_gradients", True)):
                for p in self.ref.parameters():
                    if p.grad is not None:
                        p.grad /= self.n_mb

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

    def check_idle(self, label):
        """After a finalizing step: no pending FSDP gradients, no unsharded parameter storage."""
        for mod in self.mods:
            for sub in mod.modules():
                if not isinstance(sub, FSDPModule):
                    continue
                for g in sub._get_fsdp_state()._fsdp_param_groups:
                    self.ctx.check("no pending gradients", not g._post_backward_pending, f"{label} {sub.__class__.__name__}")
                    held = sum(fp._unsharded_param.untyped_storage().nbytes() for fp in g.fsdp_params
                               if getattr(fp, "_unsharded_param", None) is not None)
                    self.ctx.check("resharded", held == 0, f"{label}: {held} B unsharded")
