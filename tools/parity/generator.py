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
    "fsdp": [("aux", False), ("mp", False), ("mesh", "1d"), ("world", 2), ("manual_final", False), ("chunked", False),
             ("raf", True), ("blocks", "per_block"), ("head", "separate"), ("frozen_embed", False),
             ("norm_in_forward", True), ("n_mb", 1), ("n_chunks", 2), ("offload", False), ("replicate", False),
             ("root_raf", None), ("lazy_init_fails", False)],
    "pp": [("world", 2), ("kind", "plain"), ("shared", "none"), ("scale_grads", False), ("n_mb", 2),
           ("caller_raf", True)],
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


def _fsdp_ops(rng: random.Random, oracle: str, lay: dict, extra: random.Random, r5: random.Random) -> list:
    """``extra`` draws what revision 4's generator added, ``r5`` what revision 5's added, so that
    each seed's earlier draws stay."""
    ops = []
    for _ in range(rng.randint(1, 3)):
        # Under manual finalization the root's groups reduce in finalize_backward(): no-sync until then
        syncs = ["every", "last"] + (["rs_only"] if lay["mesh"] == "hsdp" else [])  # rs_only: all-reduce on the last
        train = {"op": "train", "sync": "last" if lay["manual_final"] else rng.choice(syncs)}
        if oracle == "a":
            train["is_last_backward"] = rng.random() < 0.3
            train["prefetch_head"] = lay["head"] in ("separate", "grouped") and rng.random() < 0.3
        elif lay["head"] in ("separate", "grouped") and extra.random() < 0.3:
            train["prefetch_head"] = True  # unshard(async_op=True) of the head before the step
        if lay["n_mb"] >= 2 and not lay["chunked"] and not lay["manual_final"] and extra.random() < 0.15:
            train["fail_mb"] = extra.randrange(lay["n_mb"] - 1)  # its loss raises on every rank
        _fsdp_train_r5(r5, lay, train)
        ops.append(train)
        if rng.random() < 0.3:
            ops.append({"op": rng.choice(["eval", "state_dict", "reshard"])
                        if oracle == "b" else rng.choice(["eval", "eval_grad", "state_dict", "reshard"])})
            if ops[-1]["op"] == "eval" and lay["chunked"] and lay["head"] in SCOPE_HEADS and r5.random() < 0.5:
                ops[-1]["op"] = "eval_chunked"  # a no_grad chunk loop inside partial_backward (issue 33 point 1)
        ops.append({"op": "optim"})
    return ops


SCOPE_HEADS = ("separate", "grouped", "tied")  # heads with an FSDP group of their own: the scope's module


def _has_sub_fsdp(lay: dict) -> bool:
    """Whether the layout has an FSDP module below the root."""
    return lay["blocks"] == "per_block" or lay["head"] in SCOPE_HEADS or lay["aux"]


def _root_raf_ok(lay: dict) -> bool:
    """Whether the root may reshard after forward: not under ``replicate()`` (which never does), and
    only if no parameter of the root's own group is used after the root forward (the head computes
    outside it: with ``head="root"``, or the norm of a separate head outside the forward, the
    program would call a module whose parameters are sharded again)."""
    if lay.get("replicate"):
        return False
    return lay["head"] in ("grouped", "tied") or (lay["head"] == "separate" and lay["norm_in_forward"])


def _fsdp_layout_r6(r6, oracle: str, lay: dict) -> None:
    """The mutation check's additions to an FSDP layout (issue 32): the root's
    ``set_reshard_after_forward(True)`` before the first forward (2.15.0's setter, which the root's
    lazy initialization must not override: 0002), and in oracle b a first forward whose lazy
    initialization raises, followed by ``reset_iter_state()`` (0012)."""
    root_raf, lazy = r6.random(), r6.random()
    lay["root_raf"] = True if root_raf < 0.15 and _root_raf_ok(lay) else None
    lay["lazy_init_fails"] = oracle == "b" and lazy < 0.15 and _has_sub_fsdp(lay)


def _fsdp_train_r5(r5: random.Random, lay: dict, train: dict) -> None:
    """Revision 5's additions to a training step of an FSDP program (issue 32 point 3, issue 33):
    a forward that raises on every rank; in oracle b's chunked loss a microbatch whose scope runs
    no backward (dropped by a loss guard), a grad-enabled head call outside the scope whose output
    is detached, an exception inside a chunk's backward followed by ``reset_iter_state()``."""
    n_mb, last_only = lay["n_mb"], train["sync"] != "every"
    plain_loop = n_mb >= 2 and not lay["chunked"] and not lay["manual_final"]
    if "fail_mb" in train and r5.random() < 0.4:
        train["fail_mb"], train["fail_in"] = 0, "forward"  # a reset discards the microbatches before it
    elif plain_loop and "fail_mb" not in train and r5.random() < 0.1:
        train["fail_mb"], train["fail_in"] = 0, "forward"
    if not lay["chunked"]:
        return
    if lay["head"] in SCOPE_HEADS and not lay["manual_final"] and r5.random() < 0.2:
        # not the last microbatch of a step that reduces only there (nothing would be reduced)
        choices = [mb for mb in range(n_mb) if not (last_only and mb == n_mb - 1 and n_mb > 1)]
        if choices:
            train["drop_mb"] = r5.choice(choices)
    if r5.random() < 0.2:
        train["head_metric"] = True
    if (n_mb >= 2 and train["sync"] == "last" and lay["head"] in ("separate", "grouped") and not lay["aux"]
            and not lay["manual_final"] and train.get("drop_mb") != 0 and r5.random() < 0.4):
        # microbatch 0, chunk 1: its backward raises, then reset_iter_state() or first a scope entry
        # that must refuse naming it (issue 33 point 3); or its head forward raises inside the scope
        # (before finish_forward), then reset_iter_state()
        train["fail_chunk"] = r5.choice(["backward", "backward_noreset", "backward_noreset", "forward"])


def _pp_layout(rng: random.Random, oracle: str, r5: random.Random) -> dict:
    """``r5`` draws what revision 5's generator added (container stages in oracle A, shared layers
    on FSDP and container stages, the caller's ``reshard_after_forward=False``), so that each seed's
    earlier draws stay."""
    schedule = rng.choice(list(PP_SCHEDULES))
    placement = PP_SCHEDULES[schedule]
    kind = rng.choice(["plain", "plain", "fsdp", "container"])
    if oracle == "a" and kind == "container" and (schedule in ZERO_BUBBLE or r5.random() < 0.5):
        # Container stages accumulate like FSDP stages (0024): their collectives differ from 2.15.0
        # by design (the allowlist pins that and compares the rest); half of them stay FSDP stages
        kind = "fsdp"
    if oracle == "a" and schedule in ZERO_BUBBLE and kind == "fsdp":
        # 2.15.0 computes no weight gradient there: an allowlisted difference (0014)
        kind = "plain"
    shared = "none"
    if kind == "plain" and rng.random() < 0.5:
        shared = {"loop": "layers", "v": "tied"}.get(placement, "none")
    world = 4 if kind != "plain" and rng.random() < 0.3 else 2
    lay = {"schedule": schedule, "placement": placement, "kind": kind, "shared": shared, "world": world,
           "n_mb": 4 if schedule == "ScheduleDualPipeV" else rng.choice([2, 4]), "scale_grads": rng.random() < 0.5}
    if kind == "container" and placement == "loop" and r5.random() < 0.35:
        # a block shared by a rank's two stages, sharded once (issue 35); not on FSDP-root stages:
        # FSDP2 refuses a child of two roots ("already been lazily initialized"), 2.15.0 alike
        lay["shared"] = "layers"
    lay["caller_raf"] = not (kind != "plain" and r5.random() < 0.25)
    return lay


def _pp_ops(rng: random.Random, oracle: str, lay: dict, r5: random.Random) -> list:
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
            op = {"op": "eval", "no_grad": rng.random() < 0.3}
            # A loss that runs its own backward in grad-mode eval() (issue 32): every stage kind in
            # oracle b; oracle a only on plain stages (2.15.0 drops FSDP gradients at the switch)
            if not op["no_grad"] and (oracle == "b" or lay["kind"] == "plain") and r5.random() < 0.5:
                op["loss_backward"] = True
                grads = True
            ops.append(op)
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
    # FSDP2's no-sync idiom across steps (issue 34 point 2): steps under the caller's no-sync, then
    # one that syncs; the old setter in both oracles (oracle a: not on FSDP-root stages, where the
    # series fixes 2.15.0 on purpose), fsdp_policy(requires_gradient_sync=False) in oracle b
    if r5.random() < 0.2 and (oracle == "b" or lay["kind"] != "fsdp"):
        idiom = "setter" if oracle == "a" or r5.random() < 0.5 else "scope"
        ops += [{"op": "nosync", "steps": r5.choice([1, 2]), "idiom": idiom},
                {"op": "step", "finalize": True}, {"op": "optim"}]
    # A step that fails on one rank only (issue 32 point 3, issue 34 points 1 and 4): the loss or a
    # stage forward raises there; the failed rank retries, skips the batch or exits. Last operation
    # (the process group is broken afterwards), after a clean step (so no metadata probe runs in it)
    if lay["world"] == 2 and r5.random() < 0.08:
        n_stages = 2 if lay["placement"] == "single" else 4
        where = r5.choice(["loss", "forward"])
        ops += [{"op": "step", "finalize": True}, {"op": "optim"},
                {"op": "fail", "where": where, "stage": r5.randrange(n_stages) if where == "forward" else n_stages - 1,
                 "mb": r5.randrange(lay["n_mb"]), "after": r5.choice(["retry", "skip", "exit"])}]
    return ops


def _pp_ops_r5b(r5b, oracle: str, lay: dict, ops: list) -> None:
    """Draws of the revision-5 mutation check: half of oracle b's no-sync idioms on FSDP or
    container stages (not the V schedules, whose eval() fails on 2.15.0) start with a grad-mode
    eval() whose loss runs its own backward under the caller's no-sync; it must leave nothing
    pending (0019), so its gradients are not part of the accumulation."""
    if oracle != "b" or lay["kind"] == "plain" or lay["placement"] == "v":
        return
    for op in ops:
        if op["op"] == "nosync" and r5b.random() < 0.5:
            op["eval_first"] = True


def _pp_ops_r6(r6, oracle: str, lay: dict, ops: list) -> None:
    """Draws of issue 32's mutation check on revision 5: in oracle b, one stage per rank (GPipe,
    1F1B), a step that fails on every rank after the clean first step, acknowledged with
    ``acknowledge_failed_step(all_ranks_failed=True)`` and retried (0021: the failed step's
    completed sends that it did not wait on are not "in flight", so the retry runs)."""
    if oracle != "b" or lay["placement"] != "single":
        return
    if r6.random() < 0.3:
        first = next(i for i, op in enumerate(ops) if op["op"] == "step")
        if ops[first]["finalize"] and not any(op["op"] == "fail" for op in ops):
            ops.insert(first + 1, {"op": "fail_all"})


#: The rediscovery set of seeds.json (revision 3's four bugs): its programs stay as revision 4's
#: generator drew them, so that re-introducing one of those bugs still makes its seed fail.
REDISCOVERY = {("b", 92), ("b", 57), ("b", 160), ("b", 13)}


class _NoDraws:
    """A stream whose every probability test fails: no revision 5 addition."""

    def random(self):
        return 1.0


def generate(seed: int, oracle: str) -> dict:
    """The program of ``seed`` for ``oracle`` ("a" or "b"); the same seed gives the same program."""
    if oracle not in ("a", "b"):
        raise ValueError(f"oracle must be 'a' or 'b', not {oracle!r}")
    rng = random.Random(f"{oracle}:{seed}")
    family = "pp" if rng.random() < 0.5 else "fsdp"
    # Revision 5's additions, a stream of their own; the rediscovery seeds keep revision 4's programs
    r5 = _NoDraws() if (oracle, seed) in REDISCOVERY else random.Random(f"{oracle}:{seed}:r5")
    lay = _pp_layout(rng, oracle, r5) if family == "pp" else _fsdp_layout(rng, oracle)
    extra = random.Random(f"{oracle}:{seed}:extra")
    if family == "fsdp":  # a third stream, so that the other draws stay
        lay["mp"] = random.Random(f"{oracle}:{seed}:mp").random() < 0.2  # bf16 parameters, fp32 reduction
        lay["offload"] = r5.random() < 0.12  # CPUOffloadPolicy on every fully_shard call
        # replicate() instead of fully_shard() (FSDPModules too; no reshard_after_forward argument)
        lay["replicate"] = (not lay["offload"] and not lay["mp"] and lay["mesh"] == "1d" and lay["raf"] is True
                            and r5.random() < 0.12)
    if family == "fsdp":  # a sixth stream (issue 32's mutation check on revision 5), so that the other draws stay
        _fsdp_layout_r6(_NoDraws() if (oracle, seed) in REDISCOVERY else random.Random(f"{oracle}:{seed}:r6"),
                        oracle, lay)
    ops = _pp_ops(rng, oracle, lay, r5) if family == "pp" else _fsdp_ops(rng, oracle, lay, extra, r5)
    if family == "pp":  # a fifth stream (the revision-5 mutation check), so that the other draws stay
        _pp_ops_r5b(_NoDraws() if (oracle, seed) in REDISCOVERY else random.Random(f"{oracle}:{seed}:r5b"),
                    oracle, lay, ops)
        _pp_ops_r6(_NoDraws() if (oracle, seed) in REDISCOVERY else random.Random(f"{oracle}:{seed}:r6"),
                   oracle, lay, ops)
    return {"seed": seed, "oracle": oracle, "family": family, "layout": lay, "ops": ops}


def gloo_timeout(program: dict) -> float:
    """The process-group timeout of ``program``'s ranks: short (genlib_pp.FAIL_TIMEOUT_S) when a rank
    fails alone, so that a peer that waits for it costs seconds (and is observed as "slow")."""
    return 4.0 if program["ops"] and program["ops"][-1]["op"] == "fail" else 8.0


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
        if lay.get("replicate") and (lay["mesh"] != "1d" or lay["raf"] is not True or lay.get("mp") or lay.get("offload")):
            return False
        if lay.get("root_raf") is not None and not _root_raf_ok(lay):
            return False
        if lay.get("lazy_init_fails") and (program["oracle"] != "b" or not _has_sub_fsdp(lay)):
            return False
        for op in program["ops"]:
            if "fail_mb" in op and (lay["chunked"] or lay["manual_final"] or op["fail_mb"] >= lay["n_mb"] - 1):
                return False
            if op.get("fail_in") == "forward" and op.get("fail_mb") != 0:
                return False
            if (op["op"] == "eval_chunked" or "drop_mb" in op) and not (lay["chunked"] and lay["head"] in SCOPE_HEADS):
                return False
            if "drop_mb" in op:
                k, n = op["drop_mb"], lay["n_mb"]
                if k >= n or (op["sync"] != "every" and k == n - 1 and n > 1) or lay["manual_final"]:
                    return False
            if op.get("head_metric") and not lay["chunked"]:
                return False
            if op.get("fail_chunk") and not (
                    lay["n_mb"] >= 2 and op["sync"] == "last" and lay["head"] in ("separate", "grouped")
                    and not lay["aux"] and not lay["manual_final"] and op.get("drop_mb") != 0):
                return False
        return any(op["op"] == "train" for op in program["ops"])
    if lay["kind"] != "plain" and lay["shared"] not in ("none", "layers" if lay["kind"] == "container" else "none"):
        return False  # a tied embedding would be two FSDP groups' parameter, a shared block a child of two roots
    if lay["kind"] == "plain" and lay["world"] != 2:
        return False
    ops = program["ops"]
    for i, op in enumerate(ops):
        if op["op"] == "fail":
            if i != len(ops) - 1 or lay["world"] != 2:
                return False
            earlier = [o["op"] for o in ops[:i] if o["op"] in ("step", "eval", "nosync")]
            if not earlier or earlier[-1] == "eval":  # a clean step first: no metadata probe in it
                return False
        if op["op"] == "nosync" and (i + 1 >= len(ops) or ops[i + 1] != {"op": "step", "finalize": True}):
            return False  # the step that syncs follows
        if op["op"] == "fail_all" and (program["oracle"] != "b" or lay["placement"] != "single" or i == 0
                                       or ops[i - 1] != {"op": "step", "finalize": True}):
            return False  # after a clean finalizing step (no metadata probe in it), one stage per rank
    return any(op["op"] == "step" for op in ops)


# ---- rendering ---------------------------------------------------------------

def _fsdp_groups(lay: dict) -> list:
    """Reductions of each trainable FSDP group per reducing microbatch: one (a tied head group is
    not counted, see genlib_fsdp.Reductions)."""
    n = 2 if lay["blocks"] == "per_block" else 0
    n += int(lay["aux"]) + int(lay["head"] in ("separate", "grouped"))
    root = lay["blocks"] == "none" or lay["head"] in ("separate", "root")  # a block, norm or the head
    root = root or (lay["head"] == "grouped" and not lay["frozen_embed"])  # the embedding
    return [1] * (n + int(root))


def _render_fsdp(program: dict, keep=None) -> list:
    """``keep``: the names of the checks to render (None: all of them)."""
    lay, oracle = program["layout"], program["oracle"]
    b = oracle == "b"
    want = lambda check: keep is None or check in keep  # noqa: E731
    n_mb = lay["n_mb"]
    L = [f"m, ref = make_net(norm_in_forward={lay['norm_in_forward']}, aux={lay['aux']}, "
         f"tied={lay['head'] == 'tied'}, frozen_embed={lay['frozen_embed']})"]
    L.append('mesh = init_device_mesh("cpu", ' + ('(2, 2), mesh_dim_names=("replicate", "shard"))' if lay["mesh"] == "hsdp" else '(world,))'))
    mp = ", mp_policy=mp" if lay.get("mp") else ""
    if mp:
        L.append("mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)")
    if lay.get("offload"):
        L.append("off = CPUOffloadPolicy(pin_memory=False)")
        mp += ", offload_policy=off"
    shard = "replicate" if lay.get("replicate") else "fully_shard"  # replicate() takes no reshard_after_forward
    if lay["blocks"] == "per_block":
        raf = "" if lay.get("replicate") else f", reshard_after_forward={lay['raf']}"
        L.append(f"for layer in m.layers:\n    {shard}(layer, mesh=mesh{raf}{mp})")
    if lay["aux"]:
        L.append(f"{shard}(m.mtp, mesh=mesh{mp})")
    head = {"separate": "m.lm_head", "grouped": "[m.norm, m.lm_head]",
            "tied": "[m.tok_embeddings, m.norm, m.lm_head]"}.get(lay["head"])
    if head:
        L.append(f"{shard}({head}, mesh=mesh{mp})")
    L.append(f"{shard}(m, mesh=mesh{mp})")
    if lay.get("root_raf") is not None:  # before the first forward: lazy init keeps it (0002)
        L.append(f"m.set_reshard_after_forward({lay['root_raf']}, recurse=False)")
    L.append("opt, ref_opt = torch.optim.SGD(m.parameters(), lr=LR), torch.optim.SGD(ref.parameters(), lr=LR)")
    if any(want(c) for c in REDUCTION_CHECKS):
        L.append(f"reductions = Reductions(m, tied={lay['head'] == 'tied'})")
    # Groups the decoder backward does not reach: freed when it runs (contract section 6)
    probe = []
    if lay["head"] == "separate" or (lay["head"] == "grouped" and not lay["norm_in_forward"]):
        probe.append("m.lm_head")
    if lay["aux"]:
        probe.append("m.mtp")
    if keep is not None and not want("head freed during the decoder backward"):
        probe = []
    if probe:
        L.append("held = []")
        # Oracle b: a head group whose caller's policy reduces in this microbatch holds no unreduced
        # gradient either (its reduction was issued before the decoder backward: the partial_backward
        # exit, or autograd's post-backward hook without a scope); a check, not a draw
        unreduced = b and want("head reduced before the decoder backward")
        L.append(f"{'unreduced = []' if unreduced else 'unreduced = None'}")
        L.append(f"hold_probe(m, held, lambda: [g for x in [{', '.join(probe)}] "
                 "for g in x._get_fsdp_state()._fsdp_param_groups], unreduced)")
    if lay.get("lazy_init_fails"):
        L.append("failed_lazy_init(ctx, m)")
    if lay["manual_final"]:
        L.append("m.set_manual_backward_finalization(True)")
    groups = _fsdp_groups(lay)
    step = 0
    gathered_check = any("drop_mb" in op or op["op"] == "eval_chunked" for op in program["ops"])
    for i, op in enumerate(program["ops"]):
        kind = op["op"]
        L.append(f"# op {i}: {json.dumps(op)}")
        L.append(f'ctx.phase("op {i} {kind}")')
        if kind == "train":
            L += _render_fsdp_train(lay, op, step, b, groups, n_mb, bool(probe), want)
            step += 1
        elif kind == "optim":
            if b and gathered_check and want("head not gathered across optimizer.step"):
                # a scope never leaves its groups gathered across optimizer.step() (api.md section 8)
                L.append('ctx.check("head not gathered across optimizer.step", unsharded_bytes(head_groups(m)) == 0, '
                         f'f"op {i}: {{unsharded_bytes(head_groups(m))}} B")')
            # bf16 parameters: within 5 % of the reference's largest gradient (a missing or doubled
            # reduction is off by 100 %)
            L.append(f'optim_step(ctx, m, ref, opt, ref_opt, "op {i}"' + (", rel=0.05)" if lay.get("mp") else ")"))
        elif kind in ("eval", "eval_grad"):
            ctx_mgr = "torch.no_grad()" if kind == "eval" else "contextlib.nullcontext()"
            out = "scope_of(m).finish_forward(m.head(m(t)))" if b else "m.head(m(t))"
            emulate = kind == "eval" and program.get("emulate") == "0013"
            if emulate:
                L.append("start = len(m._get_fsdp_state()._comm_ctx.post_forward_order)")
            L.append(f"t, _ = data(99, rank, 0)\nwith {ctx_mgr}:\n    ctx.tensor(\"eval\", {out})")
            if emulate:  # what 0013 does when a forward-only iteration ends, on any torch
                L.append("drop_post_forward_order(m, start)")
            # 2.15.0 (fully_shard's docstring): a group that does not reshard after forward (the
            # root's, reshard_after_forward False or an int) keeps the gathered values after a
            # forward without backward, and optimizer.step() updates only the sharded parameters, so
            # the next forward would train on pre-step weights: reshard() them (findings/gen_b_456.py;
            # oracle a too since 2026-12-05: a.119, 134, 172 failed their gradient checks on both
            # torches, which keeps rule a.fsdp.0013-post-forward-order from excusing them)
            L.append("for x in fsdp_modules(m):\n    x.reshard()")
            if b:
                if want("forward complete"):
                    L.append(f'ctx.check("forward complete", not open_forwards(m), f"op {i}: {{open_forwards(m)}}")')
        elif kind == "eval_chunked":  # oracle b: a no_grad chunk loop inside the head's scope
            L.append(f"t, _ = data(99, rank, 0)\neval_chunk_loop(ctx, m, t, {lay['n_chunks']})")
            if want("forward complete"):
                L.append(f'ctx.check("forward complete", not open_forwards(m), f"op {i}: {{open_forwards(m)}}")')
            L.append("reshard_body(m)  # 2.15.0: the root keeps its parameters after a no_grad forward")
        elif kind == "state_dict":
            L.append("m.load_state_dict(m.state_dict())")
        elif kind == "reshard":
            L.append("for x in fsdp_modules(m):\n    x.reshard()")
            if want("resharded"):
                L.append('ctx.check("resharded", unsharded_bytes(groups(m)) == 0, '
                         f'f"op {i}: {{unsharded_bytes(groups(m))}} B unsharded after reshard()")')
    return L


#: The checks that need ``genlib_fsdp.Reductions``.
REDUCTION_CHECKS = ("reductions per group == minimum", "all-reduces per group == minimum", "one debug line per reduction")


def _root_trainable(lay: dict) -> bool:
    """Whether the root's own FSDP group holds trainable parameters (see ``_fsdp_groups``)."""
    root = lay["blocks"] == "none" or lay["head"] in ("separate", "root")
    return root or (lay["head"] == "grouped" and not lay["frozen_embed"])


def _render_fsdp_train(lay, op, step, b, groups, n_mb, probe, want) -> list:
    L = []
    if b and want("bad policy refused"):
        L.append(f'refuses_bad_policies(ctx, m, "step {step}")')
    if b and want("policy restored"):
        L.append("before = policies(m)")
    if any(want(c) for c in REDUCTION_CHECKS):
        L.append("reductions.clear()")
    if probe:
        L.append("held.clear()")
        if b and want("head reduced before the decoder backward"):
            L.append("unreduced.clear()")
    if op.get("prefetch_head"):
        L.append("m.lm_head.unshard(async_op=True)")
    L.append(f"for mb in range({n_mb}):")
    L.append(f"    t, y = data({step}, rank, mb)")
    last = f"mb == {n_mb - 1}"
    sync = "True" if op["sync"] == "every" else last
    field = "requires_all_reduce" if op["sync"] == "rs_only" else "requires_gradient_sync"
    fail = op.get("fail_mb")
    ind = "    "
    if not b:
        if op["sync"] != "every":
            L.append(f"    m.set_{field}({sync}, recurse=True)")
        if op.get("is_last_backward"):
            L.append(f"    m.set_is_last_backward({last})")
    chunk_fail = op.get("fail_chunk")
    drop = op.get("drop_mb")
    if fail is not None or chunk_fail:
        L.append("    try:")
        ind += "    "
    if b:
        L.append(f"{ind}with m.fsdp_policy({field}={sync}, recurse=True):")
        ind += "    "
    if lay["chunked"]:
        kw = (f", drop=mb == {drop}" if drop is not None else "") + (", metric=True" if op.get("head_metric") else "")
        kw += (", fail_head=mb == 0" if chunk_fail == "forward" else ", fail_bwd=mb == 0") if chunk_fail else ""
        L.append(f"{ind}chunked_loss(m, t, y, {n_mb}, {lay['n_chunks']}{kw})")
    else:
        kw = (f", fail=mb == {fail}" if fail is not None else "") + (", fail_in=\"forward\"" if op.get("fail_in") else "")
        L.append(f"{ind}full_loss(m, t, y, {n_mb}, finish={b}{kw})")
    if op.get("fail_in") == "forward":
        L.append("    except InjectedError:  # on every rank, inside layers[1]'s forward\n"
                 "        m.reset_iter_state()  # the documented recovery")
    elif fail is not None:
        L.append("    except InjectedError:  # on every rank, before its backward\n        pass")
    elif chunk_fail:
        where = "head forward" if chunk_fail == "forward" else "backward"
        L.append(f"    except InjectedError:  # inside chunk 1's {where} of microbatch 0 (issue 33 point 3)\n"
                 f"        after_failed_chunk_backward(ctx, m, reset={chunk_fail != 'backward_noreset'})")
    elif (b and op["sync"] == "last" and n_mb >= 2 and drop is None
          and want("has_pending_gradients() under no-sync")):
        # a clean step's no-sync microbatches leave every trainable parameter's gradient pending (0011)
        L.append(f"    if mb < {n_mb - 1}:\n"
                 '        ctx.check("has_pending_gradients() under no-sync", not pending_everywhere(m), '
                 f'f"step {step} mb {{mb}}: False on {{pending_everywhere(m)}}")')
    if lay["manual_final"]:
        if b and _root_trainable(lay) and want("has_pending_gradients() until finalize_backward"):
            # the root's groups reduce in finalize_backward(): pending until then (0011)
            L.append('ctx.check("has_pending_gradients() until finalize_backward", m.has_pending_gradients(), '
                     f'"step {step}: False before finalize_backward()")')
        L.append("m.finalize_backward()")
    if drop is not None:
        # 2.15.0 (fully_shard's docstring): the root and groups that do not reshard after forward keep
        # their parameters after a forward with no backward; the head's scope must not (issue 33)
        L.append("reshard_body(m)")
    skips = tuple(k for k in (fail, 0 if chunk_fail else None, drop) if k is not None)
    skip = skips[0] if len(skips) == 1 else (skips or None)
    L.append(f"ref_train(ref, {step}, world, {n_mb}" + (f", skip={skip})" if skip is not None else ")"))
    if not b:
        if want("reductions per group == minimum"):
            L.append('ctx.value("reductions", sorted(reductions.count.items()))')
        return L
    # microbatches that reduce: every one or the last, without the one that failed or was dropped
    reducing = len(({n_mb - 1} if op["sync"] == "last" else set(range(n_mb))) - set(skips))
    if want("reductions per group == minimum"):
        L.append(f"expected = {sorted(reducing * g for g in groups if reducing)}  # reductions of each trainable group")
        L.append('ctx.check("reductions per group == minimum", sorted(reductions.count.values()) == expected, '
                 f'f"step {step}: {{dict(reductions.count)}} vs {{expected}}")')
    hsdp_like = lay["mesh"] == "hsdp" or lay.get("replicate")
    if want("all-reduces per group == minimum"):
        # HSDP and replicate() all-reduce each reduction, but only on the last microbatch under
        # requires_all_reduce=False before it ("rs_only"); 1-D FSDP never all-reduces (0005)
        per = 1 if op["sync"] == "rs_only" else reducing
        L.append(f"expected = {sorted(per * g for g in groups) if reducing and hsdp_like else []}  # all-reduces of each group")
        L.append('ctx.check("all-reduces per group == minimum", sorted(reductions.all_reduces.values()) == expected, '
                 f'f"step {step}: {{dict(reductions.all_reduces)}} vs {{expected}}")')
    if want("one debug line per reduction"):
        L.append('ctx.check("one debug line per reduction", reductions.logged == reductions.calls, '
                 f'f"step {step}: {{reductions.logged}} FSDP::post_backward_reduce lines for {{reductions.calls}} reductions")')
    if want("policy restored"):
        L.append('ctx.check("policy restored", policies(m) == before, f"step ' + str(step) + '")')
    if want("forward complete"):
        L.append(f'ctx.check("forward complete", not open_forwards(m), f"step {step}: {{open_forwards(m)}}")')
    if want("has_pending_gradients() after a finalized step"):
        L.append('ctx.check("has_pending_gradients() after a finalized step", not pending_anywhere(m), '
                 f'f"step {step}: True on {{pending_anywhere(m)}}")')
    if want("no pending gradients"):
        L.append('ctx.check("no pending gradients", not any(g._post_backward_pending for g in groups(m)), '
                 f'"step {step}")')
    if want("resharded"):
        L.append(f'ctx.check("resharded", unsharded_bytes(groups(m)) == 0, f"step {step}: '
                 '{unsharded_bytes(groups(m))} B unsharded after a finalized step")')
    if probe:
        L.append('ctx.check("head freed during the decoder backward", not any(held), '
                 f'f"step {step}: head groups held {{held}} B unsharded when the backward reached layers[0]")')
        if want("head reduced before the decoder backward"):
            L.append('ctx.check("head reduced before the decoder backward", not any(unreduced), '
                     f'f"step {step}: head groups held {{unreduced}} B of unreduced gradients when the backward '
                     'reached layers[0] in a reducing microbatch")')
    return L


def _render_pp(program: dict, keep=None) -> list:
    lay = program["layout"]
    b = program["oracle"] == "b"
    idle = keep is None or bool({"no pending gradients", "resharded"} & set(keep))
    extra = "" if lay.get("caller_raf", True) else ", caller_raf=False"
    if b and lay["kind"] != "plain" and (keep is None or "policy between steps == caller's" in keep):
        extra += ", policy_check=True"  # get_fsdp_policy() after every step equals the caller's
    L = [f"pipe = Pipe(ctx, rank, world, {lay['schedule']!r}, {lay['placement']!r}, {lay['kind']!r}, "
         f"shared={lay['shared']!r}, n_mb={lay['n_mb']}, scale_grads={lay['scale_grads']}{extra})"]
    data_step, pending = 0, False
    for i, op in enumerate(program["ops"]):
        kind = op["op"]
        L.append(f"# op {i}: {json.dumps(op)}")
        if kind == "step":
            extra = "" if op["finalize"] else ", finalize_gradients=False"
            L.append(f"pipe.run({data_step}{extra})")
            if op["finalize"] and b and idle:
                L.append(f'pipe.check_idle("op {i}")')
            data_step += 1
            pending = not op["finalize"]
        elif kind == "eval":
            call = f"pipe.run({50 + i}, eval_mode=True" + (", loss_backward=True)" if op.get("loss_backward") else ")")
            L.append(f"with torch.no_grad():\n    {call}" if op["no_grad"] else call)
            if op.get("loss_backward") and b and idle and not pending:
                # an evaluation step leaves no pending gradients or FSDP state (api.md section 6)
                L.append(f'pipe.check_idle("op {i}", evaluation=True)')
        elif kind == "optim":
            L.append(f'pipe.optim_step("op {i}")')
        elif kind == "zero_grad":
            L.append("pipe.zero_grad()")
        elif kind == "nosync":
            steps = [f"pipe.run({data_step + k})" for k in range(op["steps"])]
            if op.get("eval_first"):  # grad-mode eval() under the caller's no-sync first
                steps = [f"pipe.run({50 + i}, eval_mode=True, loss_backward=True)"] + (
                    [f'pipe.check_idle("op {i} eval", evaluation=True)'] if b and idle else []) + steps
            data_step += op["steps"]
            if op["idiom"] == "setter":
                L += ["pipe.set_sync(False)  # the caller's no-sync: the old setter on the stages' FSDP modules",
                      *steps, "pipe.set_sync(True)"]
            else:
                L.append("with pipe.no_sync_scope():  # requires_gradient_sync=False scopes around the steps")
                L += [f"    {x}" for x in steps]
        elif kind == "fail_all":
            L.append(f"pipe.fail_every_rank({data_step})")
            if b and idle:
                L.append(f'pipe.check_idle("op {i}")')
            data_step += 1
        elif kind == "fail":
            L.append(f"pipe.fail_one_rank({data_step}, {op['where']!r}, {op['stage']}, {op['mb']}, {op['after']!r})")
            data_step += 2
    return L


def library(family: str) -> str:
    with open(os.path.join(HERE, f"genlib_{family}.py")) as f:
        return f.read()


def render(program: dict, keep=None) -> str:
    """The source of ``body(rank, world, ctx)`` for ``program`` (after its library's text);
    ``keep``: the names of the oracle B checks to render (None: every check; scripts keep the
    failing one)."""
    lines = (_render_pp if program["family"] == "pp" else _render_fsdp)(program, keep)
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
        if "fail_mb" in op:
            out.append({**program, "ops": ops[:i] + [{k: v for k, v in op.items() if k not in ("fail_mb", "fail_in")}]
                        + ops[i + 1:]})
        for key in ("drop_mb", "head_metric", "fail_chunk", "loss_backward", "eval_first"):
            if key in op:
                out.append({**program, "ops": ops[:i] + [{k: v for k, v in op.items() if k != key}] + ops[i + 1:]})
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

def script(program: dict, failure: str = "", where: str = os.path.join(HERE, "findings"), trace=None) -> str:
    """A short standalone script of ``program`` for the directory ``where``: the program's body
    with only the failing check (``failure`` starts with its name), run by ``genscript.main``
    with the runtime imported from tools/parity (found relative to the script's directory).
    Oracle B: exits 1 with ``FAILED: <check>: ...`` while the bug is there; oracle A: prints
    rank 0's collectives per operation (compare the pristine and the patched output), or not
    with ``trace=False``; its gradient checks still exit 1."""
    trace = program["oracle"] == "a" if trace is None else trace
    lay, oracle = program["layout"], program["oracle"]
    check = failure.split(":", 1)[0].strip()
    keep = ({check} if check else None) if oracle == "b" else set()  # oracle A: the operations only
    body = render(program, keep)
    body = "\n".join(line for line in body.splitlines() if "ctx.phase(" not in line or trace)
    rel = os.path.relpath(HERE, os.path.abspath(where))
    parts = ["os.path.dirname(os.path.abspath(__file__))"] + [repr(x) for x in rel.split(os.sep) if x != "."]
    run = ("Run: python THIS_FILE, from any directory (it imports its runtime from tools/parity);\n"
           "exits 1 with FAILED: ... while the bug is there" if not trace else
           "Run: python THIS_FILE with the pristine and with the patched torch and compare the collectives")
    head = [f'"""Generated by tools/parity/generate.py: program {name(program)}.', "",
            f"layout: {json.dumps(lay, sort_keys=True)}"]
    if failure:
        head += ["", f"Fails with: {failure}"]
    head += ["", run, '"""']
    imports = ["import contextlib  # noqa: F401", "import os", "import sys", "",
               f"sys.path.insert(0, os.path.join({', '.join(parts)}))  # tools/parity",
               f"from genlib_{program['family']} import *  # noqa: E402,F401,F403 - the model, reference, checks",
               "from genscript import main  # noqa: E402", "", ""]
    timeout = gloo_timeout(program)
    tail = ["", "", 'if __name__ == "__main__":',
            f"    main(body, world={lay['world']}" + (", trace=True" if trace else "")
            + (f", timeout_s={timeout})" if timeout != 8.0 else ")")]
    return "\n".join(head + imports) + "\n" + body + "\n" + "\n".join(tail) + "\n"
