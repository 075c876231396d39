"""The program generator of tools/parity (generator.py, generate.py): determinism,
validity, the shrinker and the script writer, without starting torch processes."""

import collections
import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

PARITY = Path(__file__).resolve().parents[2] / "tools" / "parity"
sys.path.insert(0, str(PARITY))


def _load(name):
    spec = importlib.util.spec_from_file_location(name, PARITY / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


generator = _load("generator")
generate = _load("generate")

#: Names of the APIs the series adds: oracle A programs must run only what 2.15.0 has.
NEW_APIS = ["FSDPPolicy", "fsdp_policy", "partial_backward", "finish_forward", "has_pending_gradients",
            "chunked_loss", "policies(", "policy_check", "no_sync_scope", "eval_chunk_loop"]


@pytest.mark.parametrize("oracle", ["a", "b"])
def test_same_seed_same_program_and_source(oracle):
    for seed in range(50):
        a, b = generator.generate(seed, oracle), generator.generate(seed, oracle)
        assert a == b and json.loads(json.dumps(a)) == a
        assert generator.render(a) == generator.render(b)
    distinct = {json.dumps(generator.generate(s, oracle), sort_keys=True) for s in range(50)}
    assert len(distinct) == 50


def test_programs_are_valid_and_compile():
    families = set()
    for oracle in "ab":
        for seed in range(300):
            prog = generator.generate(seed, oracle)
            assert generator.valid(prog), prog
            compile(generator.source(prog), generator.name(prog), "exec")
            families.add((oracle, prog["family"]))
    assert families == {(o, f) for o in "ab" for f in ("fsdp", "pp")}


def test_oracle_a_programs_use_only_2_15_0_apis():
    for seed in range(300):
        body = generator.render(generator.generate(seed, "a"))
        for api in NEW_APIS:
            assert api not in body, (seed, api)
    for name in ("fsdp", "pp"):  # the libraries' helpers are called only by what the body calls
        lib = generator.library(name)
        assert "partial_backward" not in lib or "def chunked_loss" in lib


def test_layouts_reach_the_target_combinations():
    """The four bugs of revision 3 need these combinations; the generator must draw each."""
    seen = set()
    for seed in range(400):
        p = generator.generate(seed, "b")
        lay = p["layout"]
        if p["family"] == "pp":
            seen.add(("shared layers", lay["schedule"]) if lay["shared"] == "layers" else None)
            seen.add(("container", lay["schedule"]) if lay["kind"] == "container" else None)
        else:
            seen.add("two scopes" if lay["chunked"] and lay["aux"] and lay["head"] == "separate" else None)
            seen.add("manual scope" if lay["chunked"] and lay["manual_final"] else None)
    for want in [("shared layers", "ScheduleInterleaved1F1B"), ("shared layers", "ScheduleLoopedBFS"),
                 ("container", "ScheduleZBVZeroBubble"), "two scopes", "manual scope"]:
        assert want in seen, want


def test_shrink_candidates_are_valid_and_simpler():
    for seed in range(40):
        prog = generator.generate(seed, "b")
        for cand in generator.shrink_candidates(prog):
            assert generator.valid(cand)
            assert generator.size(cand) < generator.size(prog) or cand["ops"] != prog["ops"]
            assert generator.size(cand) <= generator.size(prog)


def test_shrink_keeps_the_failure_and_minimises(monkeypatch):
    """With a stand-in oracle (fails when an 'eval' op and a plain stage remain), the
    shrinker ends at one step, the eval and the simplest layout that still fails."""
    prog = next(p for p in (generator.generate(s, "b") for s in range(500))
                if p["family"] == "pp" and p["layout"]["kind"] == "plain" and len(p["ops"]) >= 4
                and any(o["op"] == "eval" for o in p["ops"]))

    def fake_evaluate(programs, oracle, pythons, workdir, label):
        out = {}
        for p in programs:
            bad = any(o["op"] == "eval" for o in p["ops"]) and p["layout"]["kind"] == "plain"
            out[generator.name(p)] = ("grad matches reference", "x") if bad else None
        return out

    monkeypatch.setattr(generate, "evaluate", fake_evaluate)
    shrunk, tried, detail = generate.shrink(prog, "grad matches reference", {}, "/nonexistent")
    assert tried > 0 and "shrunk" not in shrunk and detail == "x"
    assert [o["op"] for o in shrunk["ops"]] in (["step", "eval"], ["eval", "step"])
    assert all(shrunk["layout"][k] == v for k, v in generator.SIMPLEST["pp"] if k != "kind")
    assert generator.size(shrunk) < generator.size(prog)


def test_script_is_short_and_runs_the_program_with_the_failing_check():
    for oracle, seed in [("b", 0), ("b", 1), ("b", 13), ("a", 2), ("a", 99), ("b", 235)]:
        prog = generator.generate(seed, oracle)
        text = generator.script(prog, "grad matches reference: rank 0: op 2 x")
        compile(text, "script", "exec")
        body = generator.render(prog, {"grad matches reference"} if oracle == "b" else set())
        assert "\n".join(x for x in body.splitlines() if "ctx.phase(" not in x or oracle == "a") in text
        assert "Fails with: grad matches reference" in text
        assert re.search(r"^    main\(body, world=[24](, trace=True)?(, timeout_s=4.0)?\)$", text, re.M)
        imports = {m.split()[1].split(".")[0] for m in re.findall(r"^(?:import|from) \S+", text, re.M)}
        assert imports <= {"contextlib", "os", "sys", f"genlib_{prog['family']}", "genscript"}
        assert len(text.splitlines()) <= 90, (oracle, seed, len(text.splitlines()))
        for other in ("reductions per group == minimum", "policy restored", "no pending gradients",
                      "head freed during the decoder backward"):
            assert other not in text  # only the failing check
        # the runtime it imports is tools/parity, found from the script's own directory
        line = next(x for x in text.splitlines() if x.startswith("sys.path.insert"))
        where = PARITY / "findings" / "x.py"
        path = eval(line.split("sys.path.insert(0, ", 1)[1].rsplit(")", 1)[0],
                    {"os": __import__("os"), "__file__": str(where)})
        assert Path(path).resolve() == PARITY
    text = generator.script(generator.generate(13, "b"), "", "/tmp/elsewhere")
    line = next(x for x in text.splitlines() if x.startswith("sys.path.insert"))
    path = eval(line.split("sys.path.insert(0, ", 1)[1].rsplit(")", 1)[0],
                {"os": __import__("os"), "__file__": "/tmp/elsewhere/x.py"})
    assert Path(path).resolve() == PARITY


def test_committed_findings_are_short_scripts():
    for path in sorted((PARITY / "findings").glob("gen_*.py")):
        text = path.read_text()
        compile(text, str(path), "exec")
        assert len(text.splitlines()) <= 80, path
        assert "from genscript import main" in text, path


def test_oracle_b_evaluation_reshards_before_the_optimizer_step():
    """2.15.0 keeps a group that does not reshard after forward (the root's) gathered after a
    no_grad forward, and the optimizer updates only the sharded parameters: oracle B programs
    reshard() after each evaluation forward (known.json 'harness', findings/gen_b_456.py)."""
    seen = 0
    for seed in range(200):
        prog = generator.generate(seed, "b")
        if prog["family"] != "fsdp" or not any(o["op"] == "eval" for o in prog["ops"]):
            continue
        lines = generator.render(prog).splitlines()
        for i, line in enumerate(lines):
            if line.strip().startswith('ctx.tensor("eval"'):
                assert lines[i + 1:i + 3] == ["    for x in fsdp_modules(m):", "        x.reshard()"], seed
                seen += 1
    assert seen >= 5


def test_failure_b_and_a_signatures():
    ok = {"outcome": "done", "ranks": [{"outcome": "ok", "events": [["phase", "x"]]}] * 2}
    assert generate.failure_b(ok) is None
    bad = {"outcome": "done", "ranks": [{"outcome": "ok", "events": [["check_failed", "resharded", "2048 B"]]}]}
    assert generate.failure_b(bad) == ("resharded", "rank 0: 2048 B")
    assert generate.failure_b({"outcome": "TIMEOUT", "ranks": []})[0] == "TIMEOUT"
    a = {"outcome": "done", "ranks": [{"outcome": "ok", "events": [["grads", {"w": "1"}]]}]}
    b = {"outcome": "done", "ranks": [{"outcome": "ok", "events": [["grads", {"w": "2"}]]}]}
    assert generate.failure_a(a, a) is None
    assert generate.failure_a(a, b)[0] == "differs: grads"


def test_seed_sets_and_known_failures_are_well_formed():
    sets = json.loads((PARITY / "seeds.json").read_text())["sets"]
    assert "ci" in sets
    work = generate.seed_set("ci", str(PARITY / "seeds.json"))
    assert {o for o, _ in work} == {"a", "b"}
    known, rules = generate.load_known(str(PARITY / "known.json"))
    for entry in known:
        assert (entry["oracle"], entry["seed"]) in work, entry
        assert (PARITY / entry["script"]).is_file(), entry["script"]
    data = json.loads((PARITY / "known.json").read_text())
    for entry in data.get("fixed", []) + data.get("harness", []):
        assert (PARITY / entry["script"]).is_file(), entry["script"]
    for rule in rules:
        if "example" in rule:
            assert (PARITY / rule["example"]).is_file(), rule["example"]
    assert rules and all(r["bug"].strip() for r in rules)


SERIES = {"kind": "series", "revision": 4}
PRISTINE = {"kind": "pristine"}
REV3 = {"kind": "series", "revision": 3}


def _rule(torch, **extra):
    return {"id": f"b.fsdp.{torch}", "oracle": "b", "family": "fsdp", "signatures": ["head freed"],
            "layout": {"manual_final": True}, "bug": f"a {torch} bug", "torch": torch, **extra}


PROG_B = {"oracle": "b", "family": "fsdp", "seed": 8, "layout": {"manual_final": True}, "ops": [{"op": "step"}]}


def test_a_fixed_rule_never_excuses_the_current_series():
    """Issue 32 point 1: a match with a rule for a bug revision 4 fixed is a FAIL naming the rule."""
    fixed = _rule("fixed", fixed_in="revision 4", pristine=False, fixed_by="0010-x.patch")
    status, rid, text = generate.judge(PROG_B, ("head freed", "rank 0: 2048 B"), [fixed], {}, {}, SERIES)
    assert (status, rid) == ("FAIL", "b.fsdp.fixed")
    assert "matches rule b.fsdp.fixed (fixed): regression: fixed in revision 4 by 0010-x.patch" in text
    assert generate.judge(PROG_B, ("head freed", "x"), [fixed], {}, {}, REV3)[0] == "KNOWN"
    assert generate.judge(PROG_B, ("head freed", "x"), [fixed], {}, {}, PRISTINE)[0] == "FAIL"
    # a 2.15.0 bug the series fixes excuses only 2.15.0's observation
    pristine_only = _rule("fixed", fixed_in="revision 1", pristine=True)
    assert generate.judge(PROG_B, ("head freed", "x"), [pristine_only], {}, {}, PRISTINE)[0] == "KNOWN"
    assert generate.judge(PROG_B, ("head freed", "x"), [pristine_only], {}, {}, SERIES)[0] == "FAIL"
    kept = _rule("kept")
    assert all(generate.judge(PROG_B, ("head freed", "x"), [kept], {}, {}, t)[0] == "KNOWN"
               for t in (SERIES, PRISTINE, REV3))
    opened = _rule("open", seen_in="revision 4")
    assert generate.judge(PROG_B, ("head freed", "x"), [opened], {}, {}, SERIES)[0] == "KNOWN"
    assert generate.judge(PROG_B, ("head freed", "x"), [opened], {}, {}, {"kind": "series", "revision": 5})[0] == "FAIL"
    # a rediscovery seed of a fixed bug that fails again with its old signature
    old = {("b", 8): {"oracle": "b", "seed": 8, "signature": "head freed", "bug": "issue 24 point 1",
                      "script": "findings/gen_b_13.py", "fixed_in": "revision 4"}}
    status, _, text = generate.judge(PROG_B, ("head freed", "x"), [kept], old, {}, SERIES)
    assert status == "FAIL" and "regression of a bug fixed in revision 4: issue 24 point 1" in text


def test_an_intended_difference_never_excuses_a_failed_own_check():
    rule = {"id": "a.pp.0022", "oracle": "a", "family": "pp", "signatures": ["differs: grads"], "bug": "0022",
            "torch": "intended", "patch": "0022-x.patch"}
    prog = {"oracle": "a", "family": "pp", "seed": 1, "layout": {}, "ops": []}
    assert generate.judge(prog, ("differs: grads", "x"), [rule], {}, {}, SERIES)[0] == "KNOWN"
    status, _, text = generate.judge(prog, ("differs: grads", "x", "grad matches reference"), [rule], {}, {}, SERIES)
    assert status == "FAIL" and "fails its own check (grad matches reference)" in text
    assert generate.judge(prog, ("differs: grads", "x"), [rule], {}, {}, PRISTINE)[0] == "FAIL"


def test_rule_counts_that_grow_or_shrink_fail():
    assert generate.compare_counts({"r": ["gen.b.1"]}, {"r": ["gen.b.1"]}) == []
    grown = generate.compare_counts({"r": ["gen.b.1", "gen.b.8"]}, {"r": ["gen.b.1"]})
    assert grown == [(True, "COUNT r: 2 programs, 1 expected (grew; newly matching: gen.b.8)")]
    shrunk = generate.compare_counts({}, {"r": ["gen.b.1"]})
    assert shrunk == [(True, "COUNT r: 0 programs, 1 expected (shrank; no longer matching: gen.b.1)")]
    moved = generate.compare_counts({"r": ["gen.b.2"]}, {"r": ["gen.b.1"]})
    assert moved[0][0] and "moved" in moved[0][1]


def test_known_rules_name_their_torch(tmp_path):
    _, rules = generate.load_known(str(PARITY / "known.json"))
    assert all(r["torch"] in generate.RULE_TORCHES for r in rules)
    assert len({r["id"] for r in rules}) == len(rules)
    # the rules for revision 3's findings no longer excuse the current series
    for rid in ("b.fsdp.manual-final-head-held", "b.pp.shared-layer-grad-none-after-eval"):
        rule = next(r for r in rules if r["id"] == rid)
        assert generate.judge_rule(rule, SERIES) is not None and generate.judge_rule(rule, REV3) is None
    bad = tmp_path / "known.json"
    bad.write_text(json.dumps({"known": [], "rules": [{**_rule("fixed"), "pristine": True}]}))
    with pytest.raises(ValueError, match="lacks fixed_in"):
        generate.load_known(str(bad))
    bad.write_text(json.dumps({"known": [], "rules": [{**_rule("kept"), "torch": "both"}]}))
    with pytest.raises(ValueError, match="is not one of"):
        generate.load_known(str(bad))
    expected = PARITY / "expected-ci.json"
    if expected.exists():
        data = json.loads(expected.read_text())
        ids = {r["id"] for r in rules}
        assert set(data["rules"]) <= ids, set(data["rules"]) - ids


def test_rules_match_by_signature_layout_and_ops():
    rules = [{"oracle": "b", "family": "pp", "signatures": ["grad present"], "layout": {"shared": "layers"},
              "ops": ["eval"], "bug": "x"}]
    prog = {"oracle": "b", "family": "pp", "layout": {"shared": "layers"}, "ops": [{"op": "step"}, {"op": "eval"}]}
    assert generate.matching_rule(prog, "grad present", rules) is rules[0]
    assert generate.matching_rule(prog, "resharded", rules) is None
    assert generate.matching_rule({**prog, "ops": [{"op": "step"}]}, "grad present", rules) is None
    assert generate.matching_rule({**prog, "layout": {"shared": "none"}}, "grad present", rules) is None


def test_oracle_a_confirms_0013_with_the_emulating_program(monkeypatch):
    """A collective difference after a no_grad evaluation is named 0013's only when pristine 2.15.0,
    running the program with the evaluation's post-forward order dropped by hand, observes exactly
    what the patched torch does."""
    prog = next(p for p in (generator.generate(s, "a") for s in range(500))
                if p["family"] == "fsdp" and any(o["op"] == "eval" for o in p["ops"]))
    plain, emulating = generator.render(prog), generator.render({**prog, "emulate": "0013"})
    assert "drop_post_forward_order" not in plain and "drop_post_forward_order(m, start)" in emulating
    assert "def drop_post_forward_order" in generator.library("fsdp")
    compile(generator.source({**prog, "emulate": "0013"}), "x", "exec")
    coll = lambda size: {"outcome": "done", "ranks": [{"outcome": "ok", "events": [["coll", "ag", 2, [[size]]]]}]}  # noqa: E731

    def fake_parallel(jobs):
        return [{generator.name(prog): coll(512 if "pristine" in label else 1088)} for _, _, _, label in jobs]

    for emulated_size, suffix in [(1088, generate.EMULATED_0013), (512, "")]:
        monkeypatch.setattr(generate, "run_parallel", fake_parallel)
        monkeypatch.setattr(generate, "run_programs", lambda programs, python, workdir, label, size=emulated_size: {
            generator.name(programs[0]): coll(size if label.endswith("-0013") else 512)})
        verdict = generate.evaluate([prog], "a", {"pristine": "p", "patched": "q"}, "/nonexistent", "t")
        assert verdict[generator.name(prog)][0] == "differs: coll" + suffix


def test_loss_failure_on_every_rank_is_drawn_rendered_and_shrunk():
    """A microbatch's loss raises on every rank before its backward (not the last microbatch, FSDP
    programs without chunking or manual finalization): the program goes on, the reference skips
    that microbatch, and oracle B expects one reduction fewer when every microbatch reduces."""
    for oracle in "ab":
        progs = [p for p in (generator.generate(s, oracle) for s in range(500))
                 if any("fail_mb" in o for o in p["ops"])]
        assert len(progs) >= 5, oracle
        for prog in progs:
            op = next(o for o in prog["ops"] if "fail_mb" in o)
            k = op["fail_mb"]
            body = generator.render(prog)
            assert re.search(rf"fail=mb == {k}[,)]", body) and f"skip={k})" in body and "except InjectedError:" in body
            cands = generator.shrink_candidates(prog)
            fails = sum("fail_mb" in o for o in prog["ops"])
            assert any(sum("fail_mb" in o for o in c["ops"]) == fails - 1 and len(c["ops"]) == len(prog["ops"])
                       for c in cands)
            bad = {**prog, "ops": [{**o, "fail_mb": prog["layout"]["n_mb"] - 1} if o is op else o for o in prog["ops"]]}
            assert not generator.valid(bad)
    prog = next(p for p in (generator.generate(s, "b") for s in range(500))
                if any(o.get("fail_mb") is not None and o["sync"] == "every" for o in p["ops"]))
    n_mb = prog["layout"]["n_mb"]
    assert re.search(rf"expected = \[({n_mb - 1}(, )?)+\]", generator.render(prog))


def test_mixed_precision_layouts():
    """bf16 parameters with fp32 reduction on every fully_shard call of the program, drawn from a
    stream of its own; oracle B compares gradients within 5 % of the reference's largest."""
    for oracle in "ab":
        progs = [p for p in (generator.generate(s, oracle) for s in range(300))
                 if p["family"] == "fsdp" and p["layout"]["mp"]]
        assert len(progs) >= 10, oracle
        for prog in progs:
            body = generator.render(prog)
            calls = re.findall(r"fully_shard\((.*)\)$", body, re.M)
            assert calls and all(", mp_policy=mp" in c for c in calls), calls
            assert "optim_step(" not in body or ', rel=0.05)' in body
            plain = generator.render({**prog, "layout": {**prog["layout"], "mp": False}})
            assert "mp_policy" not in plain and "rel=" not in plain
    assert ("mp", False) in generator.SIMPLEST["fsdp"]


def _programs(oracle, n=500, family=None):
    progs = [generator.generate(s, oracle) for s in range(n)]
    return [p for p in progs if family is None or p["family"] == family]


def test_one_rank_failure_is_drawn_rendered_and_last():
    """A step whose loss or stage forward raises on one rank only (issue 32 point 3, issue 34):
    the failed rank retries, skips the batch or exits; the program text carries the injection,
    it is the last operation, after a clean step, on 2 ranks."""
    for oracle in "ab":
        progs = [p for p in _programs(oracle, family="pp") if p["ops"][-1]["op"] == "fail"]
        assert len(progs) >= 8, oracle
        seen = set()
        for prog in progs:
            op = prog["ops"][-1]
            seen |= {op["where"], op["after"]}
            assert prog["layout"]["world"] == 2 and generator.valid(prog)
            body = generator.render(prog)
            assert f"pipe.fail_one_rank(" in body and f"{op['where']!r}, {op['stage']}, {op['mb']}, {op['after']!r})" in body
            moved = {**prog, "ops": [prog["ops"][-1]] + prog["ops"][:-1]}
            assert not generator.valid(moved)  # never before another operation, never first
            assert all(c["ops"][-1]["op"] != "fail" or generator.valid(c) for c in generator.shrink_candidates(prog))
        assert seen == {"loss", "forward", "retry", "skip", "exit"}, (oracle, seen)
    lib = generator.library("pp")
    # the failed rank stays alive until the healthy ranks are done (the store, not gloo); the time to
    # error is an observation; a retry must be refused
    assert "store.wait(" in lib and '"fast" if took < FAST_S else "slow"' in lib and "retry refused" in lib


def test_no_sync_idiom_across_steps():
    """FSDP2's accumulation idiom across pipeline steps (issue 34 point 2): steps under the caller's
    no-sync (old setter, or fsdp_policy scopes in oracle b), then a syncing step; the reference
    scales the whole accumulation once (the sum of the steps' means)."""
    idioms = {"a": set(), "b": set()}
    for oracle in "ab":
        for prog in _programs(oracle, family="pp"):
            ops = prog["ops"]
            for i, op in enumerate(ops):
                if op["op"] != "nosync":
                    continue
                idioms[oracle].add((op["idiom"], prog["layout"]["kind"]))
                assert ops[i + 1] == {"op": "step", "finalize": True}
                body = generator.render(prog)
                assert ("pipe.set_sync(False)" in body and "pipe.set_sync(True)" in body) if op["idiom"] == "setter" \
                    else "with pipe.no_sync_scope():" in body
                assert not generator.valid({**prog, "ops": ops[:i + 1] + ops[i + 2:]})
    assert {i for i, _ in idioms["b"]} == {"setter", "scope"} and {k for _, k in idioms["b"]} == {"plain", "fsdp", "container"}
    assert idioms["a"] and all(i == "setter" and k != "fsdp" for i, k in idioms["a"])  # 2.15.0 is wrong on FSDP-root stages
    assert "not self.nosync" in generator.library("pp")


def test_issue_33_scope_shapes():
    """Oracle b's chunked loss: a scope with no backward (a dropped microbatch; a no_grad chunk
    loop), a grad-enabled head call outside the scope whose output is detached, an exception
    inside a chunk backward followed by reset_iter_state(); the head must not stay gathered across
    optimizer.step()."""
    found = collections.Counter()
    for prog in _programs("b", family="fsdp"):
        body = generator.render(prog)
        for op in prog["ops"]:
            if "drop_mb" in op:
                found["drop"] += 1
                assert f"drop=mb == {op['drop_mb']}" in body and "reshard_body(m)" in body
                assert "head not gathered across optimizer.step" in body
            if op.get("head_metric"):
                found["metric"] += 1
                assert "metric=True" in body
            if op.get("fail_chunk"):
                found["chunk " + op["fail_chunk"]] += 1
                assert ("fail_head=mb == 0" if op["fail_chunk"] == "forward" else "fail_bwd=mb == 0") in body
                assert "skip=0)" in body or "skip=(0, " in body
                assert f"after_failed_chunk_backward(ctx, m, reset={op['fail_chunk'] != 'backward_noreset'})" in body
            if op["op"] == "eval_chunked":
                found["no_grad loop"] += 1
                assert "eval_chunk_loop(ctx, m, t," in body and "head not gathered across optimizer.step" in body
    assert all(found[k] >= 3 for k in ("drop", "metric", "no_grad loop")), found
    assert all(found["chunk " + k] >= 1 for k in ("backward", "backward_noreset", "forward")), found
    for prog in _programs("a", family="fsdp"):
        assert not any({"drop_mb", "head_metric", "fail_chunk"} & set(op) or op["op"] == "eval_chunked"
                       for op in prog["ops"])
    lib = generator.library("fsdp")
    assert "def eval_chunk_loop" in lib and "c.register_hook(_raise_injected)" in lib
    assert "m.reset_iter_state()" in lib and '"reset_iter_state" in str(exc)' in lib


def test_forward_failure_offload_and_replicate_layouts():
    """A forward that raises on every rank (then reset_iter_state()), CPU offload and replicate()
    modules, in both oracles."""
    for oracle in "ab":
        progs = _programs(oracle, family="fsdp")
        fwd = [p for p in progs if any(o.get("fail_in") == "forward" for o in p["ops"])]
        off = [p for p in progs if p["layout"]["offload"]]
        rep = [p for p in progs if p["layout"]["replicate"]]
        assert len(fwd) >= 5 and len(off) >= 10 and len(rep) >= 5, (oracle, len(fwd), len(off), len(rep))
        for p in fwd:
            body = generator.render(p)
            assert 'fail_in="forward"' in body and "m.reset_iter_state()" in body
        for p in off:
            calls = re.findall(r"fully_shard\((.*)\)$", generator.render(p), re.M)
            assert calls and all("offload_policy=off" in c for c in calls)
        for p in rep:
            body = generator.render(p)
            assert "fully_shard(" not in body and "replicate(m, mesh=mesh)" in body
            assert not generator.valid({**p, "layout": {**p["layout"], "raf": False}})


def test_pipeline_layouts_of_revision_5():
    """Container stages in oracle a (never zero-bubble), a block shared by a container stage's two
    loop stages, get_fsdp_policy() read between steps in oracle b, grad-mode eval() with a loss that
    runs its own backward on every stage kind (oracle a: plain stages)."""
    a, b = _programs("a", family="pp"), _programs("b", family="pp")
    cont_a = [p for p in a if p["layout"]["kind"] == "container"]
    assert len(cont_a) >= 5 and not any(p["layout"]["schedule"] in generator.ZERO_BUBBLE for p in cont_a)
    shared = {(p["layout"]["kind"], p["layout"]["schedule"]) for p in b if p["layout"]["shared"] == "layers"}
    assert {("container", "ScheduleInterleaved1F1B"), ("container", "ScheduleLoopedBFS"),
            ("plain", "ScheduleInterleaved1F1B"), ("plain", "ScheduleLoopedBFS")} <= shared
    assert not any(p["layout"]["kind"] == "fsdp" and p["layout"]["shared"] != "none" for p in a + b)
    for p in b:
        assert ("policy_check=True" in generator.render(p)) == (p["layout"]["kind"] != "plain")
    kinds = {oracle: {p["layout"]["kind"] for p in progs for o in p["ops"] if o.get("loss_backward")}
             for oracle, progs in (("a", a), ("b", b))}
    assert kinds == {"a": {"plain"}, "b": {"plain", "fsdp", "container"}}, kinds
    for p in b:
        if any(o.get("loss_backward") for o in p["ops"]):
            assert "eval_mode=True, loss_backward=True)" in generator.render(p)


def test_rediscovery_seeds_keep_revision_4_programs():
    """The rediscovery set (revision 3's four bugs) draws none of revision 5's additions."""
    sets = json.loads((PARITY / "seeds.json").read_text())["sets"]
    assert {("b", s) for s in sets["rediscovery"]["b"]["seeds"]} == generator.REDISCOVERY
    for oracle, seed in generator.REDISCOVERY:
        prog = generator.generate(seed, oracle)
        lay = prog["layout"]
        assert not lay.get("offload") and not lay.get("replicate") and lay.get("caller_raf", True)
        assert lay.get("root_raf") is None and not lay.get("lazy_init_fails")
        assert not any({"drop_mb", "head_metric", "fail_chunk", "loss_backward", "fail_in"} & set(op)
                       or op["op"] in ("fail", "fail_all", "nosync", "eval_chunked") for op in prog["ops"])


def test_mutation_check_shapes_of_revision_5():
    """The sixth stream's draws (the root's set_reshard_after_forward before lazy init, a lazy init
    that raises, a step failing on every rank then acknowledged and retried) and the oracle B checks
    of the new APIs that every FSDP program renders."""
    a, b = _programs("a", family="fsdp"), _programs("b", family="fsdp")
    for progs in (a, b):
        raf = [p for p in progs if p["layout"]["root_raf"] is not None]
        assert len(raf) >= 5
        for p in raf:
            assert "m.set_reshard_after_forward(True, recurse=False)" in generator.render(p)
            assert not p["layout"]["replicate"] and p["layout"]["head"] != "root"
    assert not any(p["layout"]["lazy_init_fails"] for p in a)
    lazy = [p for p in b if p["layout"]["lazy_init_fails"]]
    assert len(lazy) >= 5 and all("failed_lazy_init(ctx, m)" in generator.render(p) for p in lazy)
    assert not generator.valid({**a[0], "layout": {**a[0]["layout"], "lazy_init_fails": True}})
    checks = ["refuses_bad_policies(", "all-reduces per group == minimum", "one debug line per reduction",
              "forward complete", "has_pending_gradients() after a finalized step"]
    for p in b:
        body = generator.render(p)
        assert all(c in body for c in checks), p["seed"]
    manual = [p for p in b if p["layout"]["manual_final"] and generator._root_trainable(p["layout"])]
    assert manual and all("has_pending_gradients() until finalize_backward" in generator.render(p) for p in manual)
    pp_b = _programs("b", family="pp")
    fail_all = [p for p in pp_b if any(o["op"] == "fail_all" for o in p["ops"])]
    assert len(fail_all) >= 5 and all(p["layout"]["placement"] == "single" for p in fail_all)
    assert not any(o["op"] == "fail_all" for p in _programs("a", family="pp") for o in p["ops"])
    for p in fail_all:
        i = next(i for i, o in enumerate(p["ops"]) if o["op"] == "fail_all")
        assert p["ops"][i - 1] == {"op": "step", "finalize": True}
        assert "pipe.fail_every_rank(" in generator.render(p)


def test_one_rank_failure_programs_run_with_a_short_process_group_timeout():
    prog = generator.generate(235, "b")
    assert prog["ops"][-1]["op"] == "fail" and generator.gloo_timeout(prog) == 4.0
    assert generator.gloo_timeout(generator.generate(0, "b")) == 8.0
    assert "main(body, world=2, timeout_s=4.0)" in generator.script(prog, "x: y")
    lib = generator.library("pp")
    assert "FAIL_TIMEOUT_S, FAST_S = 4.0, 2.0" in lib  # generator.gloo_timeout's value
