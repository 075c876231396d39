"""The parity runner's comparison logic (tools/parity/runner.py), on recorded
observations: no torch process is started, so one torch (or none) suffices."""

import importlib.util
import json
import re
from pathlib import Path

import pytest

PARITY = Path(__file__).resolve().parents[2] / "tools" / "parity"


def _load(name):
    spec = importlib.util.spec_from_file_location(f"parity_{name}", PARITY / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


runner = _load("runner")


def obs(*events, outcome="ok", ranks=2):
    return {"outcome": "done", "ranks": [{"outcome": outcome, "events": [list(e) for e in events]}
                                         for _ in range(ranks)]}


AG = ("coll", "all_gather_single", 2, [[32, "float32"], [16, "float32"]])
RS = ("coll", "reduce_scatter_single", 2, [[16, "float32"], [32, "float32"]])


def run(results_a, results_b, results_c=None, entries=()):
    a = {"results": results_a}
    c = {"results": results_c if results_c is not None else results_a}
    return runner.evaluate([a, c], {"results": results_b}, list(entries))


def test_identical_observations_are_same():
    o = obs(AG, ("grads", {"w": "x"}), RS)
    assert runner.compare(o, json.loads(json.dumps(o))) is None
    lines, summary, failed = run({"s": o}, {"s": o})
    assert lines == ["SAME s", "PARITY: 1/1 scenarios identical"] and not failed
    assert summary["s"]["status"] == "SAME"


def test_extra_collective_is_a_diff_with_counts():
    a = obs(("phase", "forward 1"), AG, RS)
    b = obs(("phase", "forward 1"), AG, AG, RS)
    text = runner.compare(a, b)
    assert text.startswith("rank 0 event 2 (after 'forward 1'): ")
    assert "all_gather_single 2 vs 4" in text and "reduce_scatter_single" not in text.split("[")[-1]
    lines, _, failed = run({"s": a}, {"s": b})
    assert lines[0].startswith("DIFF s: rank 0 event 2") and lines[-1] == "PARITY: 0/1 scenarios identical"
    assert failed


def test_changed_gradient_names_the_parameter():
    a = obs(("grads", {"w": "h1", "b": "h2"}))
    b = obs(("grads", {"w": "h1", "b": "h3"}))
    assert "grads[b]: h2 vs h3" in runner.compare(a, b)


def test_exception_and_missing_events_and_outcomes():
    a = obs(("ok", "step"), ("params", {}))
    b = obs(("exception", "ValueError", "different policies"))
    assert "ValueError" in runner.compare(a, b)
    assert "vs null" in runner.compare(a, obs(("ok", "step")))
    assert runner.compare(obs(), obs(outcome="error")) == "rank 0 outcome ok vs error"
    assert runner.compare({"outcome": "TIMEOUT", "ranks": []}, obs()) == "outcome TIMEOUT vs done"
    assert runner.compare(obs(ranks=2), obs(ranks=4)) == "2 vs 4 ranks"
    assert runner.compare(obs(), None).startswith("missing")


def test_nondeterministic_pristine_fails_even_when_patched_matches():
    a, b = obs(("tensor", "loss", "h1")), obs(("tensor", "loss", "h2"))
    lines, summary, failed = run({"s": a}, {"s": a}, {"s": b})
    assert lines[0].startswith("NONDET s: ") and failed
    assert lines[-1] == "PARITY: 0/1 scenarios identical"


def test_allowlisted_diff_passes_and_stale_entry_fails():
    a, b = obs(AG, AG), obs(AG)
    entry = {"scenario": "fsdp.eval.*", "reason": "one stale prefetch fewer", "patch": "0010-x.patch",
             "may_differ": ["collectives"]}
    lines, _, failed = run({"fsdp.eval.no_grad": a, "other": a}, {"fsdp.eval.no_grad": b, "other": a},
                           entries=[entry])
    assert lines[0].startswith("DIFF fsdp.eval.no_grad: ") and "allowlisted: 0010-x.patch" in lines[0]
    assert lines[1] == "SAME other" and lines[-1] == "PARITY: 1/2 scenarios identical" and not failed
    lines, _, failed = run({"fsdp.eval.no_grad": a}, {"fsdp.eval.no_grad": a}, entries=[entry])
    assert lines[0].startswith("STALE fsdp.eval.no_grad") and failed
    # the message says what stopped appearing, and never advises deleting the entry
    assert "collectives" in lines[0] and "stopped appearing" in lines[0]
    assert "remove the entry" not in lines[0].lower() and "delete" not in lines[0].lower()


def test_pinned_collectives_catch_a_changed_intended_difference(tmp_path):
    """Issue 32: an entry that pins a scenario's collectives (``collectives_pinned``) allows that
    intended difference only: one all-gather more than pinned (mutant 0016's extra all-gathers at an
    eval() between accumulation steps) fails, naming the counts; an unpinned scenario of the same
    entry is judged as before; ``--pin-collectives`` writes the pins of scenarios whose totals agree
    between runs and leaves those that vary unpinned."""
    a, b, more = obs(AG, AG, RS), obs(AG, RS), obs(AG, RS, AG)
    entry = {"scenario": "pp.*.eval_step", "reason": "fewer all-gathers", "patch": "0016-x.patch",
             "may_differ": ["collectives"], "collectives_pinned": {"pp.gpipe.eval_step": {
                 "all_gather_single": 2, "reduce_scatter_single": 2}}}
    lines, _, failed = run({"pp.gpipe.eval_step": a}, {"pp.gpipe.eval_step": b}, entries=[entry])
    assert not failed and "allowlisted: 0016-x.patch" in lines[0]
    lines, _, failed = run({"pp.gpipe.eval_step": obs(AG)}, {"pp.gpipe.eval_step": more}, entries=[entry])
    moved = lines[0].split("(all ranks): ", 1)[1].split(";", 1)[0]
    assert failed and moved == "all_gather_single 4 (pinned 2)"
    assert "delete" not in lines[0].lower() and "remove" not in lines[0].lower()
    lines, _, failed = run({"pp.1f1b.eval_step": obs(AG)}, {"pp.1f1b.eval_step": more}, entries=[entry])
    assert not failed  # not pinned
    # the loader checks the pins
    path = tmp_path / "allowlist.json"
    for bad, match in (({**entry, "may_differ": ["state"]}, "without 'collectives'"),
                       ({**entry, "collectives_pinned": {"fsdp.x": {}}}, "does not match"),
                       ({**entry, "collectives_pinned": {"pp.gpipe.eval_step": {"x": -1}}}, "counts")):
        path.write_text(json.dumps({"entries": [bad]}))
        with pytest.raises(ValueError, match=match):
            runner.load_allowlist(str(path))
    # writing pins from two runs: the varying scenario stays unpinned
    path.write_text(json.dumps({"entries": [{k: v for k, v in entry.items() if k != "collectives_pinned"}]}))
    runs = []
    for i, extra in enumerate(([], [AG])):
        raw = tmp_path / f"raw{i}.json"
        raw.write_text(json.dumps({"results": {"pp.gpipe.eval_step": b, "pp.v.eval_step": obs(RS, *extra)}}))
        runs.append(str(raw))
    assert runner.main(["--pristine-python", "x", "--patched-python", "x", "--allowlist", str(path),
                        "--pin-collectives", *runs]) == 0
    pinned = runner.load_allowlist(str(path))[0]["collectives_pinned"]
    assert pinned == {"pp.gpipe.eval_step": {"all_gather_single": 2, "reduce_scatter_single": 2}}


def _grads(scale=1.0, bits="h1"):
    return ("grads", {"w": f"(4,):float32:{bits}"}, {"w": [1.0 * scale, 2.0 * scale, 0.5 * scale]})


CONTAINER = {"scenario": "pp.gpipe.container*", "reason": "0024", "patch": "0024-x.patch",
             "may_differ": ["collectives", "rounding"]}


def test_allowlisted_collectives_do_not_excuse_gradients():
    """Issue 32: an entry for a container stage's collectives still compares its gradients; a
    regression that divides them again (off by 4x) is a DIFF, summation order alone is not."""
    a = obs(AG, RS, ("phase", "optimizer step 1"), _grads())
    rounding = obs(AG, ("phase", "optimizer step 1"), _grads(1.0 + 1e-7, bits="h2"))
    quartered = obs(AG, ("phase", "optimizer step 1"), _grads(0.25, bits="h3"))
    lines, _, failed = run({"pp.gpipe.container": a}, {"pp.gpipe.container": rounding}, entries=[CONTAINER])
    assert "allowlisted: 0024-x.patch: differs in collectives, rounding" in lines[0] and not failed
    lines, _, failed = run({"pp.gpipe.container": a}, {"pp.gpipe.container": quartered}, entries=[CONTAINER])
    assert failed and lines[0].startswith("DIFF pp.gpipe.container: rank 0 numbers event")
    assert "beyond rounding" in lines[0] and "beyond what the allowlist entry" in lines[0]
    # only collectives allowed: the same rounding is a difference (bits compared)
    strict = {**CONTAINER, "may_differ": ["collectives"]}
    lines, _, failed = run({"pp.gpipe.container": a}, {"pp.gpipe.container": rounding}, entries=[strict])
    assert failed and "(bitwise)" in lines[0]
    # an exception or a state change behind allowlisted collectives is still compared
    raised = obs(AG, ("phase", "optimizer step 1"), _grads(), ("exception", "ValueError", "x"))
    lines, _, failed = run({"pp.gpipe.container": a}, {"pp.gpipe.container": raised}, entries=[CONTAINER])
    assert failed and "exceptions event" in lines[0]


def test_pristine_wrong_numbers_are_judged_by_the_reference():
    entry = {"scenario": "pp.zbv.fsdp", "reason": "0014", "patch": "0014-x.patch", "may_differ": ["numbers"]}
    a = obs(_grads(0.5, bits="p"), ("ref", "grads before optimizer step 1", "off: w beyond 0.0001"))
    good = obs(_grads(bits="q"), ("ref", "grads before optimizer step 1", "ok"))
    bad = obs(_grads(0.25, bits="r"), ("ref", "grads before optimizer step 1", "off: w beyond 0.0001"))
    lines, _, failed = run({"pp.zbv.fsdp": a}, {"pp.zbv.fsdp": good}, entries=[entry])
    assert not failed and "allowlisted" in lines[0]
    lines, _, failed = run({"pp.zbv.fsdp": a}, {"pp.zbv.fsdp": bad}, entries=[entry])
    assert failed and "misses the float64 reference at 'grads before optimizer step 1'" in lines[0]
    lines, _, failed = run({"pp.zbv.fsdp": obs(_grads(0.5))}, {"pp.zbv.fsdp": obs(_grads())}, entries=[entry])
    assert failed and "records no float64 reference" in lines[0]
    # an open bug names the reference records the patched torch may still miss, and goes STALE when fixed
    opened = {**entry, "open": {"refs": ["grads before optimizer step 1"], "bug": "open bug X"}}
    lines, _, failed = run({"pp.zbv.fsdp": a}, {"pp.zbv.fsdp": bad}, entries=[opened])
    assert not failed and "OPEN: misses the reference at grads before optimizer step 1: open bug X" in lines[0]
    lines, _, failed = run({"pp.zbv.fsdp": a}, {"pp.zbv.fsdp": good}, entries=[opened])
    assert failed and any(line.startswith("STALE pp.zbv.fsdp: its open bug no longer shows") for line in lines)


def test_stale_kind_of_an_entry_names_what_stopped_appearing():
    """An entry whose named kind differs in none of its scenarios is STALE, naming that kind."""
    a, b = obs(AG, AG, ("phase", "x"), _grads()), obs(AG, ("phase", "x"), _grads())
    lines, _, failed = run({"pp.gpipe.container": a}, {"pp.gpipe.container": b}, entries=[CONTAINER])
    stale = [line for line in lines if line.startswith("STALE pp.gpipe.container*")]
    assert failed and len(stale) == 1
    assert "rounding no longer differs in any of its 1 scenario(s)" in stale[0] and "summation order" in stale[0]
    assert "remove the entry" not in stale[0].lower() and "delete" not in stale[0].lower()


def test_scenario_only_on_one_side_is_a_diff():
    lines, _, failed = run({"s": obs()}, {"s": obs(), "new": obs()})
    assert lines[1].startswith("DIFF new: missing") and failed


def test_allowlist_entries_need_scenario_reason_patch_and_kinds(tmp_path):
    path = tmp_path / "allowlist.json"
    path.write_text(json.dumps({"entries": [{"scenario": "a", "reason": "", "patch": "p", "may_differ": ["state"]}]}))
    with pytest.raises(ValueError, match="lacks reason"):
        runner.load_allowlist(str(path))
    path.write_text(json.dumps({"entries": [{"scenario": "a", "reason": "r", "patch": "p"}]}))
    with pytest.raises(ValueError, match="lacks may_differ"):
        runner.load_allowlist(str(path))
    path.write_text(json.dumps({"entries": [{"scenario": "a", "reason": "r", "patch": "p", "may_differ": ["grads"]}]}))
    with pytest.raises(ValueError, match="not among"):
        runner.load_allowlist(str(path))
    assert runner.load_allowlist(str(tmp_path / "none.json")) == []
    for entry in runner.load_allowlist(str(PARITY / "allowlist.json")):  # the shipped one parses
        assert entry["scenario"]


#: Names of the APIs the series adds: scenarios must run only what 2.15.0 has.
NEW_APIS = ["FSDPPolicy", "fsdp_policy", "partial_backward", "finish_forward", "has_pending_gradients"]


def test_scenarios_use_only_2_15_0_apis():
    sources = sorted(PARITY.glob("scenarios_*.py"))
    assert len(sources) >= 2
    for path in sources:
        text = path.read_text()
        for name in NEW_APIS:
            assert not re.search(rf"\b\w*{name}\w*\b", text), f"{path.name} uses {name}"


def test_gloo_transport_failures_compare_equal():
    a = obs(("exception", "RuntimeError", "[/x/gloo/transport/tcp/pair.cc:561] Connection closed by peer"))
    b = obs(("exception", "RuntimeError", "[/x/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting ?ms "
                                          "for recv operation to complete"))
    assert runner.compare(a, b) is None
    assert runner.compare(a, obs(("exception", "RuntimeError", "other"))) is not None


def test_summary_names_later_exceptions_and_numbers():
    vote_a, vote_b = ("coll", "all_reduce", 2, [[1, "int32"]]), ("coll", "all_reduce", 2, [[2, "int32"]])
    a = obs(vote_a, ("phase", "step 1"), ("grads", {"w": "h1"}), ("ok", "step"))
    b = obs(vote_b, ("phase", "step 1"), ("grads", {"w": "h2"}), ("exception", "ValueError", "no single policy"))
    text = runner.compare(a, b)
    assert text.startswith("rank 0 event 0 (after 'start'): ")
    assert "raised only on the patched torch: 'ValueError: no single policy'" in text
    assert "numbers differ from 'step 1'" in text
