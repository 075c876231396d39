"""Generated programs: random training programs run against two oracles.

    python tools/parity/generate.py --oracle a|b [--seed S] [--count N] [--budget-s T]
        --patched-python PY [--pristine-python PY] [--shrink] [--scripts DIR]
    python tools/parity/generate.py --set ci --pristine-python PY --patched-python PY

Oracle ``a`` runs programs that use only torch 2.15.0's APIs on the pristine
and the patched torch and compares every observation (``runner.compare``);
oracle ``b`` runs programs that may use the series' APIs on the patched torch
against the checks the program makes itself (gradients against an unsharded
single-process reference, reductions per FSDP group per step, no pending
gradients and no unsharded storage after a finalizing step, the caller's
policy restored; a hang is a ``TIMEOUT``). Each worker imports torch once and
forks the ranks of every program (``worker.py --programs``). Prints one line
per program, the count per ``known.json`` rule and ``GENERATED: ...``. Each rule
names the torch its behaviour lives in (``torch``: 2.15.0 behaviour the series
keeps, a bug fixed in a revision of the series, an intended difference); a
failure excuses (``KNOWN``) only on a torch the rule names, so on the current
series a match with a fixed bug's rule is a ``FAIL`` naming it. Exits 1 on any
``FAIL``, on a rediscovery seed that passes (``FIXED``) and, for a committed
seed set with expected counts (``expected-<set>.json``), on a rule count that
differs from the committed one. ``--shrink`` shrinks each failure (drop operations, simplify the
layout) and ``--scripts DIR`` writes each shrunk failure as a standalone
script. Standard library only.
"""

import argparse
import ast
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import generator  # noqa: E402
import runner  # noqa: E402

KNOWN = os.path.join(HERE, "known.json")
BATCH = 40  # programs per worker start (one torch import each)
EMULATED_0013 = " (as 2.15.0 with 0013 emulated)"  # signature suffix, see evaluate()


def _log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def run_programs(programs: list, python: str, workdir: str, label: str) -> dict:
    """Runs ``programs`` in one worker under ``python``; returns ``{name: observation}``."""
    return run_parallel([(programs, python, workdir, label)])[0]


def run_parallel(jobs: list) -> list:
    """``jobs``: ``(programs, python, workdir, label)``; runs them at the same time (2 cores: 2 workers)."""
    procs = []
    for programs, python, workdir, label in jobs:
        path = os.path.join(workdir, f"{label}-programs.json")
        out = os.path.join(workdir, f"{label}-out.json")
        with open(path, "w") as f:
            json.dump([{"name": generator.name(p), "world": p["layout"]["world"], "source": generator.source(p),
                        "timeout": 60.0, "gloo_timeout": generator.gloo_timeout(p)} for p in programs], f)
        cmd = [python, os.path.join(HERE, "worker.py"), "--programs", path, "--out", out]
        procs.append((subprocess.Popen(cmd, cwd=HERE, stdout=subprocess.DEVNULL), out, label))
    results = []
    for proc, out, label in procs:
        if proc.wait() != 0:
            raise SystemExit(f"generate: the {label} worker failed (exit {proc.returncode})")
        with open(out) as f:
            results.append(json.load(f)["results"])
    return results


def failure_b(obs: dict):
    """Oracle B: the first failed check (or uncaught exception, exit or timeout) of any rank, else None."""
    if obs is None:
        return "missing", ""
    if obs.get("outcome") == "TIMEOUT":
        return "TIMEOUT", "a rank outlived the program timeout"
    for rank, r in enumerate(obs.get("ranks", [])):
        for e in r.get("events", []):
            if e and e[0] == "check_failed":
                return e[1], f"rank {rank}: {e[2]}"
            if e and e[0] == "uncaught":
                return f"raised {e[1]}", f"rank {rank}: {' '.join(e[2])[:200]}"
        if r.get("outcome") != "ok":
            return f"rank outcome {r.get('outcome')}", f"rank {rank}"
    return None


def _value_detail(x, y) -> str:
    """For two ``value`` events of one label recording ``[exception type, "fast" | "slow"]`` (a
    failure's outcome and the hang detector's verdict): which half differs, pristine's first, so
    that a rule can excuse the series failing faster and never the series failing slower."""
    if x[0] != "value" or y[0] != "value" or len(x) < 3 or len(y) < 3 or x[1] != y[1]:
        return ""
    try:
        a, b = ast.literal_eval(x[2]), ast.literal_eval(y[2])
    except (ValueError, SyntaxError):
        return ""
    if not (isinstance(a, list) and isinstance(b, list) and len(a) == len(b) == 2):
        return ""
    if a[0] != b[0]:
        return f" ({a[0]} vs {b[0]})"
    if a[1] != b[1]:
        return f" ({a[1]} vs {b[1]})"
    return ""


def failure_a(pristine: dict, patched: dict):
    """Oracle A: the kind of the first difference (what the shrinker keeps) and its text, else None."""
    text = runner.compare(pristine, patched)
    if text is None:
        return None
    kind = text.split(": ", 1)[1] if ": " in text else text
    kind = kind.split("[", 1)[0].split(":", 1)[0].strip(' "[')
    for ra, rb in zip(pristine.get("ranks", []), patched.get("ranks", [])):
        ea, eb = runner._canon(ra.get("events", [])), runner._canon(rb.get("events", []))
        for x, y in zip(ea, eb):
            if x != y:
                kind = f"{x[0]} vs {y[0]}" if x[0] != y[0] else x[0]
                kind += _value_detail(x, y)
                if x[0] in ("check_failed", "uncaught") or y[0] in ("check_failed", "uncaught"):
                    kind += f" ({(y if y[0] in ('check_failed', 'uncaught') else x)[1]})"
                break
        else:
            continue
        break
    return f"differs: {kind}", text[:400]


def evaluate(programs: list, oracle: str, pythons: dict, workdir: str, label: str) -> dict:
    """``{name: (signature, detail) or None}`` for ``programs``."""
    if oracle == "b":
        res = run_programs(programs, pythons["patched"], workdir, label)
        return {generator.name(p): failure_b(res.get(generator.name(p))) for p in programs}
    pristine, patched = run_parallel([(programs, pythons["pristine"], workdir, label + "-pristine"),
                                      (programs, pythons["patched"], workdir, label + "-patched")])
    out = {}
    for p in programs:
        n = generator.name(p)
        out[n] = failure_a(pristine.get(n), patched.get(n))
    differing = [p for p in programs if out[generator.name(p)]]
    if differing:  # the determinism check: pristine again for every difference
        again = run_programs(differing, pythons["pristine"], workdir, label + "-pristine2")
        for p in differing:
            n = generator.name(p)
            nondet = runner.compare(pristine.get(n), again.get(n))
            if nondet:
                out[n] = ("NONDET", nondet[:400])
    # 0013 (intended): after a no_grad forward of the root, 2.15.0's next backward prefetches by the
    # stale post-forward order; confirmed when 2.15.0 with that order dropped by hand (the program's
    # "emulate") observes exactly what the patched torch does
    suspects = [p for p in differing if out[generator.name(p)][0] != "NONDET" and p["family"] == "fsdp"
                and any(op["op"] == "eval" for op in p["ops"])]
    if suspects:
        emulated = run_programs([{**p, "emulate": "0013"} for p in suspects], pythons["pristine"], workdir,
                                label + "-pristine-0013")
        for p in suspects:
            n = generator.name(p)
            if runner.compare(emulated.get(n), patched.get(n)) is None:
                out[n] = (out[n][0] + EMULATED_0013, out[n][1])
    for p in differing:  # the patched torch's own failed check, which no rule about 2.15.0 excuses
        n = generator.name(p)
        own = _own_check_failure(patched.get(n))
        if out[n] and own:
            out[n] = (out[n][0], out[n][1], own)
    return out


def _own_check_failure(obs):
    """The first ``check_failed`` of an observation (a program's own check), else None."""
    for r in (obs or {}).get("ranks", []):
        for e in r.get("events", []):
            if e and e[0] == "check_failed":
                return e[1]
    return None


def shrink(program: dict, signature: str, pythons: dict, workdir: str, max_rounds: int = 12) -> tuple:
    """Greedy: the smallest candidate that fails with the same signature, until none does."""
    best, tried, detail = program, 0, None
    for round_ in range(max_rounds):
        cands = sorted(generator.shrink_candidates(best), key=generator.size)
        if not cands:
            break
        for i, c in enumerate(cands):
            c["shrunk"] = f"{round_}x{i}"
        verdicts = evaluate(cands, best["oracle"], pythons, workdir, f"shrink{round_}")
        tried += len(cands)
        same = [c for c in cands if verdicts[generator.name(c)] and verdicts[generator.name(c)][0] == signature]
        if not same:
            break
        best, detail = same[0], verdicts[generator.name(same[0])][1]
        _log(f"    shrink round {round_ + 1}: {len(best['ops'])} ops, size {generator.size(best)}")
    best = {k: v for k, v in best.items() if k != "shrunk"}
    return best, tried, detail


#: What a rule's ``torch`` says about where its behaviour lives (docs/parity.md, "Known rules").
RULE_TORCHES = {
    "kept": "2.15.0 behaviour that the series deliberately keeps (both torches show it)",
    "fixed": "a bug that revision fixed_in of the series fixed (2.15.0's too when pristine is true)",
    "intended": "an intended difference of the series from 2.15.0 (oracle a; patch names it)",
    "open": "an open bug of the series seen on revision seen_in (it excuses that revision only)",
}


def load_known(path: str) -> tuple:
    """``(seeds, rules)`` of ``known.json``: failures of named seeds (a shrunk script each) and
    rules that name a class of failures by oracle, signature, layout and operations, each with the
    torch its behaviour lives in."""
    if not os.path.exists(path):
        return [], []
    with open(path) as f:
        data = json.load(f)
    for e in data["known"]:
        missing = [k for k in ("oracle", "seed", "signature", "bug", "script") if k not in e]
        if missing:
            raise ValueError(f"known.json entry {e!r} lacks {', '.join(missing)}")
    ids = set()
    for r in data.get("rules", []):
        missing = [k for k in ("id", "oracle", "signatures", "family", "bug", "torch") if k not in r]
        if missing:
            raise ValueError(f"known.json rule {r.get('id', r)!r} lacks {', '.join(missing)}")
        if r["torch"] not in RULE_TORCHES:
            raise ValueError(f"known.json rule {r['id']!r}: torch {r['torch']!r} is not one of {sorted(RULE_TORCHES)}")
        need = {"fixed": ("fixed_in", "pristine"), "intended": ("patch",), "open": ("seen_in",)}.get(r["torch"], ())
        missing = [k for k in need if k not in r]
        if missing:
            raise ValueError(f"known.json rule {r['id']!r} ({r['torch']}) lacks {', '.join(missing)}")
        if r["torch"] == "intended" and r["oracle"] != "a":
            raise ValueError(f"known.json rule {r['id']!r}: an intended difference is an oracle a rule")
        if r["id"] in ids:
            raise ValueError(f"known.json: duplicate rule id {r['id']!r}")
        ids.add(r["id"])
    return data["known"], data.get("rules", [])


def load_fixed(path: str) -> dict:
    """``{(oracle, seed): entry}`` of known.json's ``fixed`` list (seeds whose bug a revision fixed)."""
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return {(e["oracle"], e["seed"]): e for e in json.load(f).get("fixed", [])}


def _revision_number(text) -> int:
    return int(str(text).split()[-1])


def judge_rule(rule: dict, torch: dict):
    """``None`` when ``rule`` excuses a failure observed on ``torch`` (``{"kind": "pristine"}`` or
    ``{"kind": "series", "revision": N}``; for oracle a, the patched side), else why it does not.

    A rule excuses only the torch its behaviour lives in: 2.15.0 behaviour the series keeps on
    both; a fixed bug on 2.15.0 (when 2.15.0 has it) and on revisions before the fixing one, never
    on the current series, where its match is a regression; an intended difference on the series."""
    kind = torch.get("kind")
    where = rule["torch"]
    if where == "kept":
        return None
    if where == "intended":
        return None if kind == "series" else "an intended difference of the series, but the patched torch is 2.15.0"
    if where == "open":
        if kind == "series" and torch.get("revision") == _revision_number(rule["seen_in"]):
            return None
        return f"an open bug seen on revision {rule['seen_in']}, not on this torch: triage it again"
    # fixed
    if kind == "pristine":
        return None if rule["pristine"] else "a bug of the series only (2.15.0 does not have it)"
    fixed_in = _revision_number(rule["fixed_in"])
    if kind == "series" and torch.get("revision") is not None and torch["revision"] < fixed_in:
        return None
    by = f" by {rule['fixed_by']}" if rule.get("fixed_by") else ""
    return f"regression: fixed in revision {fixed_in}{by}"


def torch_of(python: str) -> dict:
    """Which torch ``python`` runs: ``{"kind": "pristine"}`` or ``{"kind": "series", "revision": N}``
    (from ``python -m torch_patches status``; a series with a file changed since it was applied, a
    mutant, is judged as that series), plus ``state``."""
    repo = os.path.dirname(os.path.dirname(HERE))
    env = {**os.environ, "PYTHONPATH": repo + os.pathsep + os.environ.get("PYTHONPATH", "")}
    try:
        out = subprocess.run([python, "-m", "torch_patches", "status", "--python", python], cwd=repo, env=env,
                             capture_output=True, text=True, timeout=120).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise SystemExit(f"generate: cannot tell which torch {python} runs: {exc} (pass --torch)")
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line and not line.startswith(" "))
    recorded, state = fields.get("recorded", "").strip(), fields.get("state", "").strip()
    if recorded.startswith("series revision"):
        return {"kind": "series", "revision": int(recorded.split()[2].rstrip(",")), "state": state}
    if state == "not applied":
        return {"kind": "pristine", "state": state}
    raise SystemExit(f"generate: cannot tell which torch {python} runs (state {state!r}); pass --torch")


def parse_torch(text: str) -> dict:
    """``--torch``: ``pristine`` or ``series:N``."""
    if text == "pristine":
        return {"kind": "pristine", "state": "--torch"}
    if text.startswith("series:"):
        return {"kind": "series", "revision": int(text.split(":", 1)[1]), "state": "--torch"}
    raise SystemExit(f"generate: --torch {text!r}: want pristine or series:N")


def describe_torch(torch: dict) -> str:
    return "pristine 2.15.0" if torch["kind"] == "pristine" else f"series revision {torch['revision']}"


def judge(program: dict, verdict, rules: list, fixed: dict, known: dict, torch: dict) -> tuple:
    """``(status, rule id or None, text)`` for one program's verdict: ``PASS``, ``KNOWN``, ``FAIL``
    or ``FIXED`` (a rediscovery seed of ``known`` that passes)."""
    key = (program["oracle"], program["seed"])
    entry = known.get(key)
    if verdict is None:
        if entry is not None:
            return "FIXED", None, f"known failure {entry['bug']!r} no longer fails: update known.json"
        return "PASS", None, ""
    sig, detail = verdict[0], verdict[1]
    if entry is not None:
        if sig == entry["signature"]:
            return "KNOWN", None, f"{sig} ({entry['bug']}; {entry['script']})"
        return "FAIL", None, f"{sig}: {detail} [a known seed, which failed with {entry['signature']!r}]"
    old = fixed.get(key)
    rule = matching_rule(program, sig, rules)
    if old is not None and sig == old["signature"] and torch["kind"] == "series":
        why = f"regression of a bug fixed in {old['fixed_in']}: {old['bug']} ({old['script']})"
        return "FAIL", rule and rule["id"], f"{sig}: {detail} [{why}]"
    if rule is None:
        return "FAIL", None, f"{sig}: {detail}"
    why = judge_rule(rule, torch)
    if why is None and program["oracle"] == "a" and rule["torch"] in ("intended", "fixed") and len(verdict) > 2 \
            and verdict[2]:
        # oracle a: a rule about 2.15.0's observation never excuses the patched torch's own failed check
        why = f"the patched torch fails its own check ({verdict[2]}); the rule excuses 2.15.0's observation only"
    if why is None:
        return "KNOWN", rule["id"], f"{sig}: {detail[:160]} ({rule['id']}: {rule['bug']})"
    return "FAIL", rule["id"], f"{sig}: {detail[:300]} [matches rule {rule['id']} ({rule['torch']}): {why} on " \
                               f"{describe_torch(torch)}: {rule['bug']}]"


def compare_counts(counts: dict, expected: dict) -> list:
    """``(failed, line)`` per rule whose count differs from the committed one.

    ``counts``/``expected``: ``{rule id: [seed names]}``. A count that grows fails (a new program
    matches: a regression the rule would otherwise hide); one that shrinks fails as well (a program
    the rule named passes or fails otherwise now: the behaviour changed, which is a change of the
    series or of the generator to explain before the counts are updated)."""
    out = []
    for rid in sorted(set(counts) | set(expected)):
        have, want = counts.get(rid, []), expected.get(rid, [])
        if len(have) == len(want) and sorted(have) == sorted(want):
            continue
        new = [n for n in have if n not in want]
        gone = [n for n in want if n not in have]
        change = "grew" if len(have) > len(want) else "shrank" if len(have) < len(want) else "moved"
        text = f"COUNT {rid}: {len(have)} programs, {len(want)} expected ({change}"
        text += f"; newly matching: {', '.join(new)}" if new else ""
        text += f"; no longer matching: {', '.join(gone)}" if gone else ""
        out.append((True, text + ")"))
    return out


def matching_rule(program: dict, signature: str, rules: list):
    """The first rule naming this failure: same oracle and family, a listed signature, every
    ``layout`` field among its allowed values and every op of ``ops`` present."""
    for r in rules:
        if r["oracle"] != program["oracle"] or r["family"] != program["family"]:
            continue
        if signature not in r["signatures"]:
            continue
        lay = program["layout"]
        if any(lay.get(k) not in (v if isinstance(v, list) else [v]) for k, v in r.get("layout", {}).items()):
            continue
        if not all(any(op["op"] == want for op in program["ops"]) for want in r.get("ops", [])):
            continue
        return r
    return None


def classify(results: str, known_path: str, torch: dict) -> int:
    """Counts an earlier run's failures by the known.json rule (or seed entry) that names them."""
    seeds_known, rules = load_known(known_path)
    known = {(e["oracle"], e["seed"]): e for e in seeds_known}
    with open(results) as f:
        data = json.load(f)
    by_rule, unnamed = {}, []
    for rec in data["programs"]:
        if "signature" not in rec:
            continue
        entry = known.get((rec["oracle"], rec["seed"]))
        if entry and entry["signature"] == rec["signature"]:
            by_rule.setdefault(("seed", entry["bug"]), []).append(rec["seed"])
            continue
        rule = matching_rule(rec["program"], rec["signature"], rules)
        if rule is None:
            unnamed.append(rec["line"])
        else:
            verdict = judge_rule(rule, torch) or "excuses"
            by_rule.setdefault((rule["id"], f"{rule['torch']}: {verdict}: {rule['bug']}"), []).append(rec["seed"])
    print(f"{data['summary']}  ({data['command']})")
    for (rid, bug), seeds in sorted(by_rule.items(), key=lambda kv: -len(kv[1])):
        print(f"{len(seeds):4d}  {rid}: {bug}  (seeds {', '.join(map(str, seeds[:8]))}{', ...' if len(seeds) > 8 else ''})")
    for line in unnamed:
        print(f"   UNNAMED {line}")
    return 1 if unnamed else 0


def seed_set(name: str, path: str) -> list:
    """``[(oracle, seed)]`` of a committed seed set of ``seeds.json``."""
    with open(path) as f:
        sets = json.load(f)["sets"]
    if name not in sets:
        raise SystemExit(f"generate: no seed set {name!r} in {path} (have {', '.join(sets)})")
    out = []
    for oracle, spec in sets[name].items():
        seeds = list(range(spec["range"][0], spec["range"][1])) if "range" in spec else []
        out += [(oracle, s) for s in seeds + spec.get("seeds", [])]
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--oracle", choices=["a", "b"], default="b")
    parser.add_argument("--seed", type=int, default=0, help="first seed (programs use seed, seed+1, ...)")
    parser.add_argument("--count", type=int, default=50, help="programs to generate")
    parser.add_argument("--budget-s", type=float, default=0, help="start no new batch after this many seconds")
    parser.add_argument("--set", help="run a committed seed set of seeds.json (both oracles) instead")
    parser.add_argument("--seeds-file", default=os.path.join(HERE, "seeds.json"))
    parser.add_argument("--known", default=KNOWN, help="known failures (JSON, see docs/parity.md)")
    parser.add_argument("--expected", help="expected programs per rule (default for --set NAME: "
                                           "expected-NAME.json beside seeds.json, when it exists)")
    parser.add_argument("--write-expected", metavar="FILE",
                        help="write this run's programs per rule as the expected counts (after explaining "
                             "every change: docs/parity.md)")
    parser.add_argument("--torch", help="the patched torch's identity, pristine or series:N (default: "
                                        "python -m torch_patches status of --patched-python)")
    parser.add_argument("--patched-python")
    parser.add_argument("--pristine-python", help="required by oracle a")
    parser.add_argument("--shrink", action="store_true", help="shrink every failure that is not known")
    parser.add_argument("--scripts", help="write each shrunk failure as a standalone script in this directory")
    parser.add_argument("--print", dest="show", action="store_true", help="print the programs' source and exit")
    parser.add_argument("--results", default=os.path.join(HERE, "results"))
    parser.add_argument("--classify", metavar="GEN_LAST_JSON",
                        help="name the failures of an earlier run's gen-last.json by known.json's rules and exit")
    args = parser.parse_args(argv)
    if args.classify:
        torch = parse_torch(args.torch) if args.torch else {"kind": "series", "revision": 10 ** 6}
        return classify(args.classify, args.known, torch)
    if args.set:
        work = seed_set(args.set, args.seeds_file)
    else:
        work = [(args.oracle, s) for s in range(args.seed, args.seed + args.count)]
    if args.show:
        for oracle, seed in work:
            prog = generator.generate(seed, oracle)
            print(f"# {generator.name(prog)}: {json.dumps(prog)}\n{generator.render(prog)}")
        return 0
    if not args.patched_python:
        parser.error("--patched-python is required")
    if any(o == "a" for o, _ in work) and not args.pristine_python:
        parser.error("oracle a needs --pristine-python")
    pythons = {"patched": args.patched_python, "pristine": args.pristine_python}
    torch = parse_torch(args.torch) if args.torch else torch_of(args.patched_python)
    _log(f"==> judged torch: {describe_torch(torch)} ({torch.get('state', '')[:120]})")
    expected_path = args.expected
    if expected_path is None and args.set:
        candidate = os.path.join(os.path.dirname(os.path.abspath(args.seeds_file)), f"expected-{args.set}.json")
        expected_path = candidate if os.path.exists(candidate) else None
    seeds_known, rules = load_known(args.known)
    known = {(e["oracle"], e["seed"]): e for e in seeds_known}
    fixed = load_fixed(args.known)
    start = time.monotonic()
    lines, records, failed, complete = [], [], False, True
    counts = {"a": [0, 0, 0], "b": [0, 0, 0]}  # run, clean, known
    per_rule: dict = {}  # rule id -> [program names], KNOWN and FAIL alike
    with tempfile.TemporaryDirectory(prefix="parity-gen-") as workdir:
        for oracle in ("a", "b"):
            todo = [s for o, s in work if o == oracle]
            for b0 in range(0, len(todo), BATCH):
                if args.budget_s and time.monotonic() - start > args.budget_s:
                    _log(f"==> budget of {args.budget_s:.0f} s spent: stopping before seed {todo[b0]}")
                    complete = False
                    break
                programs = [generator.generate(s, oracle) for s in todo[b0:b0 + BATCH]]
                verdicts = evaluate(programs, oracle, pythons, workdir, f"{oracle}{b0}")
                for prog in programs:
                    n, v = generator.name(prog), verdicts[generator.name(prog)]
                    counts[oracle][0] += 1
                    rec = {"name": n, "oracle": oracle, "seed": prog["seed"], "program": prog}
                    status, rid, text = judge(prog, v, rules, fixed, known, torch)
                    if rid is not None:
                        per_rule.setdefault(rid, []).append(n)
                        rec["rule"] = rid
                    line = f"{status} {n}" + (f": {text}" if text else "")
                    if status == "PASS":
                        counts[oracle][1] += 1
                    elif status == "KNOWN":
                        counts[oracle][2] += 1
                    else:
                        failed = True
                    if status == "FAIL":
                        rec["signature"], rec["detail"] = v[0], v[1]
                        if args.shrink:
                            shrunk, tried, detail = shrink(prog, v[0], pythons, workdir)
                            rec["shrunk"], rec["shrink_tried"] = shrunk, tried
                            line += f" [shrunk to {len(shrunk['ops'])} ops in {tried} runs]"
                            if args.scripts:
                                os.makedirs(args.scripts, exist_ok=True)
                                path = os.path.join(args.scripts, f"gen_{oracle}_{prog['seed']}.py")
                                with open(path, "w") as f:
                                    f.write(generator.script(shrunk, f"{v[0]}: {detail or v[1]}", args.scripts))
                                line += f" -> {path}"
                    print(line, flush=True)
                    lines.append(line)
                    rec["line"] = line
                    records.append(rec)
                _log(f"    {counts[oracle][0]} oracle {oracle} programs, {time.monotonic() - start:.0f} s")
    seconds = round(time.monotonic() - start, 1)
    by_id = {r["id"]: r for r in rules}
    expected = None
    if expected_path:
        with open(expected_path) as f:
            expected = json.load(f)
    want = (expected or {}).get("rules", {})
    for rid in sorted(set(per_rule) | set(want)):
        rule = by_id.get(rid, {"torch": "?", "bug": "(no such rule in known.json)"})
        shown = f" (expected {len(want.get(rid, []))})" if expected is not None else ""
        print(f"RULE {len(per_rule.get(rid, [])):4d}{shown} {rid} [{rule['torch']}]", flush=True)
    count_lines = []
    if expected is not None:
        if not complete:
            count_lines.append((False, f"COUNTS: not compared with {os.path.relpath(expected_path)} (the budget "
                                       "stopped the run early)"))
        elif expected.get("torch") and expected["torch"] != describe_torch(torch):
            count_lines.append((False, f"COUNTS: not compared with {os.path.relpath(expected_path)}: its counts are "
                                       f"for {expected['torch']}, this torch is {describe_torch(torch)}"))
        else:
            count_lines = compare_counts(per_rule, want) or [
                (False, f"COUNTS: as expected ({os.path.relpath(expected_path)})")]
    for bad, line in count_lines:
        failed = failed or bad
        print(line, flush=True)
        lines.append(line)
    summary = "GENERATED: " + "; ".join(
        f"oracle {o}: {c[1]}/{c[0]} clean, {c[2]} known, {c[0] - c[1] - c[2]} failing" for o, c in counts.items() if c[0]
    ) + f" in {seconds} s"
    print(summary, flush=True)
    if args.write_expected:
        with open(args.write_expected, "w") as f:
            json.dump({"about": "Programs per known.json rule of the seed set on the torch below, compared by "
                                "generate.py (docs/parity.md, 'Known rules'); a count that grows or shrinks "
                                "fails the run. Rewrite with --write-expected only after explaining each change.",
                       "set": args.set, "torch": describe_torch(torch), "summary": summary,
                       "rules": {rid: sorted(names, key=lambda n: int(n.rsplit(".", 1)[1]))
                                 for rid, names in sorted(per_rule.items())}}, f, indent=1)
            f.write("\n")
    os.makedirs(args.results, exist_ok=True)
    with open(os.path.join(args.results, "gen-last.json"), "w") as f:
        json.dump({"command": shlex.join([os.path.relpath(sys.argv[0]), *(argv or sys.argv[1:])]),
                   "torch": torch, "summary": summary, "seconds": seconds, "rules": per_rule,
                   "counts": [line for _, line in count_lines], "programs": records}, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
