"""Random training programs for the parity oracles (standard library only).

A program is a JSON-able dict ``{"seed", "oracle", "family", "layout", "ops"}``:
``generate(seed, oracle)`` draws one, ``render(program)`` turns it into the
source of ``body(rank, world, ctx)`` (run by ``worker.py --programs`` and by
the standalone scripts of ``script()``), ``shrink_candidates(program)`` lists
the simpler programs the shrinker tries. Oracle ``a`` programs use only APIs
torch 2.15.0 has; oracle ``b`` programs may use the series' APIs.
"""

import json
import os
import random

HERE = os.path.dirname(os.path.abspath(__file__))

PP_SCHEDULES = {  # class name -> stage placement (see genlib_pp.Pipe)
    "ScheduleGPipe": "single",
    "Schedule1F1B": "single",
    "ScheduleInterleaved1F1B": "loop",
    "ScheduleLoopedBFS": "loop",
    "ScheduleInterleavedZeroBubble": "loop",
    "ScheduleZBVZeroBubble": "v",
    "ScheduleDualPipeV": "v",
}
ZERO_BUBBLE = ("ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble", "ScheduleDualPipeV")

#: The simplest value of each layout field, in the order the shrinker tries them.
SIMPLEST = {
    "fsdp": [("aux", False), ("mesh", "1d"), ("world", 2), ("manual_final", False), ("chunked", False),
             ("raf", True), ("blocks", "per_block"), ("head", "separate"), ("frozen_embed", False),
             ("norm_in_forward", True), ("n_mb", 1), ("n_chunks", 2)],
    "pp": [("world", 2), ("kind", "plain"), ("shared", "none"), ("scale_grads", False), ("n_mb", 2)],
}


# ---- drawing ---------------------------------------------------------------

def _fsdp_layout(rng: random.Random, oracle: str) -> dict:
    lay = {"world": rng.choice([2, 2, 4]), "blocks": rng.choice(["per_block", "per_block", "none"]),
           "head": rng.choice(["separate", "separate", "grouped", "tied", "root"]),
           "norm_in_forward": rng.random() < 0.7, "n_mb": rng.choice([1, 2, 3]),
           "manual_final": rng.random() < 0.3}
    lay["mesh"] = "hsdp" if lay["world"] == 4 and rng.random() < 0.5 else "1d"
    lay["raf"] = rng.choice([True, True, False] + ([2] if lay["world"] == 4 and lay["mesh"] == "1d" else []))
    lay["frozen_embed"] = lay["head"] != "tied" and rng.random() < 0.2
    lay["chunked"] = oracle == "b" and rng.random() < 0.7
    lay["n_chunks"] = rng.choice([2, 4])
    lay["aux"] = rng.random() < 0.3
    return lay


def _fsdp_ops(rng: random.Random, oracle: str, lay: dict) -> list:
    ops = []
    for _ in range(rng.randint(1, 3)):
        # Under manual finalization the root's groups reduce in finalize_backward(): no-sync until then
        syncs = ["every", "last"] + (["rs_only"] if lay["mesh"] == "hsdp" else [])  # rs_only: all-reduce on the last
        train = {"op": "train", "sync": "last" if lay["manual_final"] else rng.choice(syncs)}
        if oracle == "a":
            train["is_last_backward"] = rng.random() < 0.3
            train["prefetch_head"] = lay["head"] in ("separate", "grouped") and rng.random() < 0.3
        ops.append(train)
        if rng.random() < 0.3:
            ops.append({"op": rng.choice(["eval", "state_dict", "reshard"])
                        if oracle == "b" else rng.choice(["eval", "eval_grad", "state_dict", "reshard"])})
        ops.append({"op": "optim"})
    return ops


def _pp_layout(rng: random.Random, oracle: str) -> dict:
    schedule = rng.choice(list(PP_SCHEDULES))
    placement = PP_SCHEDULES[schedule]
    kind = rng.choice(["plain", "plain", "fsdp", "container"])
    if oracle == "a" and schedule in ZERO_BUBBLE and kind == "fsdp":
        # 2.15.0 computes no weight gradient there: an allowlisted difference (0014)
        kind = "container"
    shared = "none"
    if kind == "plain" and rng.random() < 0.5:
        shared = {"loop": "layers", "v": "tied"}.get(placement, "none")
    world = 4 if kind != "plain" and rng.random() < 0.3 else 2
    return {"schedule": schedule, "placement": placement, "kind": kind, "shared": shared, "world": world,
            "n_mb": 4 if schedule == "ScheduleDualPipeV" else rng.choice([2, 4]), "scale_grads": rng.random() < 0.5}


def _pp_ops(rng: random.Random, oracle: str, lay: dict) -> list:
    ops, pending, grads = [], False, False
    can_eval = lay["placement"] != "v"  # eval() of the V schedules fails and hangs on 2.15.0
    for _ in range(rng.randint(2, 5)):
        r = rng.random()
        if r < 0.45:
            final = rng.random() < 0.75
            ops.append({"op": "step", "finalize": final})
            pending, grads = not final, True
        elif r < 0.65 and can_eval:
            if oracle == "a" and grads and lay["kind"] != "plain":
                # Allowlisted differences: 2.15.0 drops FSDP gradients at the train-to-eval switch,
                # the series keeps them (0007/0008; between accumulation steps and after a step)
                continue
            ops.append({"op": "eval", "no_grad": rng.random() < 0.3})
        elif r < 0.9 and not pending:
            ops.append({"op": "optim"})
            grads = False
        elif not pending:
            ops.append({"op": "zero_grad"})
            grads = False
    if pending or not any(op["op"] == "step" for op in ops):
        ops += [{"op": "step", "finalize": True}, {"op": "optim"}]
    elif ops[-1]["op"] != "optim":
        ops.append({"op": "optim"})
    return ops


def generate(seed: int, oracle: str) -> dict:
    """The program of ``seed`` for ``oracle`` ("a" or "b"); the same seed gives the same program."""
    if oracle not in ("a", "b"):
        raise ValueError(f"oracle must be 'a' or 'b', not {oracle!r}")
    rng = random.Random(f"{oracle}:{seed}")
    family = "pp" if rng.random() < 0.5 else "fsdp"
    lay = _pp_layout(rng, oracle) if family == "pp" else _fsdp_layout(rng, oracle)
    ops = _pp_ops(rng, oracle, lay) if family == "pp" else _fsdp_ops(rng, oracle, lay)
    return {"seed": seed, "oracle": oracle, "family": family, "layout": lay, "ops": ops}


def name(program: dict) -> str:
    return f"gen.{program['oracle']}.{program['seed']}" + (f".s{program['shrunk']}" if program.get("shrunk") else "")


def valid(program: dict) -> bool:
    lay = program["layout"]
    if program["family"] == "fsdp":
        if lay["mesh"] == "hsdp" and lay["world"] != 4:
            return False
        if lay["raf"] == 2 and (lay["world"] != 4 or lay["mesh"] != "1d"):
            return False
        if lay["mesh"] != "hsdp" and any(op.get("sync") == "rs_only" for op in program["ops"]):
            return False
        if lay["frozen_embed"] and lay["head"] == "tied":
            return False
        if lay["chunked"] and program["oracle"] != "b":
            return False
        return any(op["op"] == "train" for op in program["ops"])
    if lay["kind"] != "plain" and lay["shared"] != "none":
        return False
    if lay["kind"] == "plain" and lay["world"] != 2:
        return False
    return any(op["op"] == "step" for op in program["ops"])


# ---- rendering ---------------------------------------------------------------

def _fsdp_groups(lay: dict) -> list:
    """Reductions of each trainable FSDP group per reducing microbatch: one (a tied head group is
    not counted, see genlib_fsdp.Reductions)."""
    n = 2 if lay["blocks"] == "per_block" else 0
    n += int(lay["aux"]) + int(lay["head"] in ("separate", "grouped"))
    root = lay["blocks"] == "none" or lay["head"] in ("separate", "root")  # a block, norm or the head
    root = root or (lay["head"] == "grouped" and not lay["frozen_embed"])  # the embedding
    return [1] * (n + int(root))


def _render_fsdp(program: dict) -> list:
    lay, oracle = program["layout"], program["oracle"]
    b = oracle == "b"
    n_mb = lay["n_mb"]
    L = [f"m, ref = make_net(norm_in_forward={lay['norm_in_forward']}, aux={lay['aux']}, "
         f"tied={lay['head'] == 'tied'}, frozen_embed={lay['frozen_embed']})"]
    L.append('mesh = init_device_mesh("cpu", ' + ('(2, 2), mesh_dim_names=("replicate", "shard"))' if lay["mesh"] == "hsdp" else '(world,))'))
    if lay["blocks"] == "per_block":
        L.append(f"for layer in m.layers:\n    fully_shard(layer, mesh=mesh, reshard_after_forward={lay['raf']})")
    if lay["aux"]:
        L.append("fully_shard(m.mtp, mesh=mesh)")
    head = {"separate": "m.lm_head", "grouped": "[m.norm, m.lm_head]",
            "tied": "[m.tok_embeddings, m.norm, m.lm_head]"}.get(lay["head"])
    if head:
        L.append(f"fully_shard({head}, mesh=mesh)")
    L.append("fully_shard(m, mesh=mesh)")
    L.append("opt, ref_opt = torch.optim.SGD(m.parameters(), lr=LR), torch.optim.SGD(ref.parameters(), lr=LR)")
    L.append(f"reductions = Reductions(m, tied={lay['head'] == 'tied'})")
    # Groups the decoder backward does not reach: freed when it runs (contract section 6)
    probe = []
    if lay["head"] == "separate" or (lay["head"] == "grouped" and not lay["norm_in_forward"]):
        probe.append("m.lm_head")
    if lay["aux"]:
        probe.append("m.mtp")
    if probe:
        L.append("held = []")
        L.append(f"hold_probe(m, held, lambda: [g for x in [{', '.join(probe)}] "
                 "for g in x._get_fsdp_state()._fsdp_param_groups])")
    if lay["manual_final"]:
        L.append("m.set_manual_backward_finalization(True)")
    groups = _fsdp_groups(lay)
    step = 0
    for i, op in enumerate(program["ops"]):
        kind = op["op"]
        L.append(f"# op {i}: {json.dumps(op)}")
        L.append(f'ctx.phase("op {i} {kind}")')
        if kind == "train":
            L += _render_fsdp_train(lay, op, step, b, groups, n_mb, bool(probe))
            step += 1
        elif kind == "optim":
            L.append(f'optim_step(ctx, m, ref, opt, ref_opt, "op {i}")')
        elif kind in ("eval", "eval_grad"):
            ctx_mgr = "torch.no_grad()" if kind == "eval" else "contextlib.nullcontext()"
            out = "scope_of(m).finish_forward(m.head(m(t)))" if b else "m.head(m(t))"
            L.append(f"t, _ = data(99, rank, 0)\nwith {ctx_mgr}:\n    ctx.tensor(\"eval\", {out})")
        elif kind == "state_dict":
            L.append("m.load_state_dict(m.state_dict())")
        elif kind == "reshard":
            L.append("for x in fsdp_modules(m):\n    x.reshard()")
            L.append('ctx.check("resharded", unsharded_bytes(groups(m)) == 0, '
                     f'f"op {i}: {{unsharded_bytes(groups(m))}} B unsharded after reshard()")')
    return L


def _render_fsdp_train(lay, op, step, b, groups, n_mb, probe) -> list:
    L = []
    if b:
        L.append("before = policies(m)")
    L.append("reductions.count.clear()")
    if probe:
        L.append("held.clear()")
    if op.get("prefetch_head"):
        L.append("m.lm_head.unshard(async_op=True)")
    L.append(f"for mb in range({n_mb}):")
    L.append(f"    t, y = data({step}, rank, mb)")
    last = f"mb == {n_mb - 1}"
    sync = "True" if op["sync"] == "every" else last
    field = "requires_all_reduce" if op["sync"] == "rs_only" else "requires_gradient_sync"
    if b:
        L.append(f"    with m.fsdp_policy({field}={sync}, recurse=True):")
        ind = "        "
    else:
        ind = "    "
        if op["sync"] != "every":
            L.append(f"    m.set_{field}({sync}, recurse=True)")
        if op.get("is_last_backward"):
            L.append(f"    m.set_is_last_backward({last})")
    if lay["chunked"]:
        L.append(f"{ind}chunked_loss(m, t, y, {n_mb}, {lay['n_chunks']})")
    else:
        L.append(f"{ind}full_loss(m, t, y, {n_mb}, finish={b})")
    if lay["manual_final"]:
        L.append("m.finalize_backward()")
    L.append(f"ref_train(ref, {step}, world, {n_mb})")
    if not b:
        L.append('ctx.value("reductions", sorted(reductions.count.items()))')
        return L
    reducing = 1 if op["sync"] == "last" else n_mb
    L.append(f"expected = {sorted(reducing * g for g in groups)}  # reductions of each trainable group")
    L.append('ctx.check("reductions per group == minimum", sorted(reductions.count.values()) == expected, '
             f'f"step {step}: {{dict(reductions.count)}} vs {{expected}}")')
    L.append('ctx.check("policy restored", policies(m) == before, f"step ' + str(step) + '")')
    L.append('ctx.check("no pending gradients", not any(g._post_backward_pending for g in groups(m)), '
             f'"step {step}")')
    L.append(f'ctx.check("resharded", unsharded_bytes(groups(m)) == 0, f"step {step}: '
             '{unsharded_bytes(groups(m))} B unsharded after a finalized step")')
    if probe:
        L.append('ctx.check("head freed during the decoder backward", not any(held), '
                 f'f"step {step}: head groups held {{held}} B unsharded when the backward reached layers[0]")')
    return L


def _render_pp(program: dict) -> list:
    lay = program["layout"]
    L = [f"pipe = Pipe(ctx, rank, world, {lay['schedule']!r}, {lay['placement']!r}, {lay['kind']!r}, "
         f"shared={lay['shared']!r}, n_mb={lay['n_mb']}, scale_grads={lay['scale_grads']})"]
    data_step = 0
    for i, op in enumerate(program["ops"]):
        kind = op["op"]
        L.append(f"# op {i}: {json.dumps(op)}")
        if kind == "step":
            extra = "" if op["finalize"] else ", finalize_gradients=False"
            L.append(f"pipe.run({data_step}{extra})")
            if op["finalize"] and program["oracle"] == "b":
                L.append(f'pipe.check_idle("op {i}")')
            data_step += 1
        elif kind == "eval":
            call = f"pipe.run({50 + i}, eval_mode=True)"
            L.append(f"with torch.no_grad():\n    {call}" if op["no_grad"] else call)
        elif kind == "optim":
            L.append(f'pipe.optim_step("op {i}")')
        elif kind == "zero_grad":
            L.append("pipe.zero_grad()")
    return L


def library(family: str) -> str:
    with open(os.path.join(HERE, f"genlib_{family}.py")) as f:
        return f.read()


def render(program: dict) -> str:
    """The source of ``body(rank, world, ctx)`` for ``program`` (after its library's text)."""
    lines = _render_pp(program) if program["family"] == "pp" else _render_fsdp(program)
    body = "\n".join(lines)
    return "def body(rank, world, ctx):\n" + "".join(f"    {line}\n" for line in body.splitlines())


def source(program: dict) -> str:
    """Library plus body: what a rank executes."""
    return library(program["family"]) + "\nimport contextlib\n\n\n" + render(program)


# ---- shrinking ---------------------------------------------------------------

def shrink_candidates(program: dict) -> list:
    """Simpler valid programs: one operation dropped, or one layout field at its simplest value."""
    out = []
    ops = program["ops"]
    for i in range(len(ops)):
        out.append({**program, "ops": ops[:i] + ops[i + 1:]})
    for i, op in enumerate(ops):
        for key, simple in (("sync", "every" if op.get("sync") == "rs_only" else "last"), ("finalize", True), ("no_grad", False), ("is_last_backward", False),
                            ("prefetch_head", False)):
            if key in op and op[key] != simple:
                out.append({**program, "ops": ops[:i] + [{**op, key: simple}] + ops[i + 1:]})
    for key, simple in SIMPLEST[program["family"]]:
        if program["layout"].get(key) != simple:
            out.append({**program, "layout": {**program["layout"], key: simple}})
    return [p for p in out if valid(p)]


def size(program: dict) -> tuple:
    """What the shrinker minimises: operations, then layout fields away from their simplest value."""
    away = sum(program["layout"].get(k) != v for k, v in SIMPLEST[program["family"]])
    return (len(program["ops"]), away)


# ---- standalone scripts --------------------------------------------------------

SCRIPT_MAIN = '''

class Ctx:
    """Oracle B's checks raise; the recording hooks of the parity worker do nothing here."""

    def check(self, what, ok, detail=""):
        if not ok:
            raise AssertionError(f"{what}: {detail}")

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


def _rank(rank, world, store):
    import datetime
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=20))
    body(rank, world, Ctx())
    dist.destroy_process_group()


if __name__ == "__main__":
    import sys
    import tempfile
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as tmp:
        try:
            mp.spawn(_rank, args=(WORLD, tmp + "/store"), nprocs=WORLD)
        except Exception as exc:  # noqa: BLE001 - the failure this script reproduces
            print(f"FAILED: {str(exc).strip().splitlines()[-1]}")
            sys.exit(1)
    print("passed")
'''


def _prune(lib: str, body: str) -> str:
    """``lib`` without its docstring and the top-level functions and classes ``body`` never reaches."""
    import ast

    tree = ast.parse(lib)
    defs = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}

    def used(node_or_text):
        tree_ = ast.parse(node_or_text) if isinstance(node_or_text, str) else node_or_text
        return {n.id for n in ast.walk(tree_) if isinstance(n, ast.Name)}

    keep, todo = set(), list(used(body) & set(defs))
    while todo:
        n = todo.pop()
        if n not in keep:
            keep.add(n)
            todo += list(used(defs[n]) & set(defs) - keep)
    lines = lib.splitlines()
    drop = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name not in keep:
            start = min([node.lineno] + [d.lineno for d in node.decorator_list])
            drop.update(range(start - 1, node.end_lineno))
        elif isinstance(node, ast.Expr) and isinstance(getattr(node, "value", None), ast.Constant):
            drop.update(range(node.lineno - 1, node.end_lineno))  # the module docstring
    text = "\n".join(line for i, line in enumerate(lines) if i not in drop)
    while "\n\n\n\n" in text:
        text = text.replace("\n\n\n\n", "\n\n\n")
    return text.strip("\n") + "\n"


def script(program: dict, failure: str = "") -> str:
    """A standalone script (torch only) that runs ``program`` on its ranks and exits 1 on a failed check."""
    lay = program["layout"]
    head = [f'"""Generated by tools/parity/generate.py: program {name(program)}.', "",
            f"layout: {json.dumps(lay, sort_keys=True)}"]
    if failure:
        head += ["", f"Fails with: {failure}"]
    head += ["", "Run: python THIS_FILE (exit 1 and FAILED: ... when the bug is present)", '"""']
    body = render(program)
    return ("\n".join(head) + "\n" + _prune(library(program["family"]), body)
            + "import contextlib\n\nWORLD = " + str(lay["world"]) + "\n\n\n" + body + SCRIPT_MAIN)
