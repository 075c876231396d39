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
per program and ``GENERATED: ...``; exits 1 on a failure that ``known.json``
does not name, or on a known failure that no longer fails (``FIXED``: update
the list). ``--shrink`` shrinks each failure (drop operations, simplify the
layout) and ``--scripts DIR`` writes each shrunk failure as a standalone
script. Standard library only.
"""

import argparse
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
    return out


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


def load_known(path: str) -> tuple:
    """``(seeds, rules)`` of ``known.json``: failures of named seeds (a shrunk script each) and
    rules that name a class of failures by oracle, signature, layout and operations."""
    if not os.path.exists(path):
        return [], []
    with open(path) as f:
        data = json.load(f)
    for e in data["known"]:
        missing = [k for k in ("oracle", "seed", "signature", "bug", "script") if k not in e]
        if missing:
            raise ValueError(f"known.json entry {e!r} lacks {', '.join(missing)}")
    for r in data.get("rules", []):
        missing = [k for k in ("oracle", "signatures", "family", "bug") if k not in r]
        if missing:
            raise ValueError(f"known.json rule {r!r} lacks {', '.join(missing)}")
    return data["known"], data.get("rules", [])


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


def classify(results: str, known_path: str) -> int:
    """Counts an earlier run's failures by the known.json rule (or seed entry) that names them."""
    seeds_known, rules = load_known(known_path)
    known = {(e["oracle"], e["seed"]): e for e in seeds_known}
    with open(results) as f:
        data = json.load(f)
    by_bug, unnamed = {}, []
    for rec in data["programs"]:
        if "signature" not in rec:
            continue
        entry = known.get((rec["oracle"], rec["seed"]))
        rule = entry if entry and entry["signature"] == rec["signature"] else matching_rule(
            rec["program"], rec["signature"], rules)
        if rule is None:
            unnamed.append(rec["line"])
        else:
            by_bug.setdefault(rule["bug"], []).append(rec["seed"])
    print(f"{data['summary']}  ({data['command']})")
    for bug, seeds in sorted(by_bug.items(), key=lambda kv: -len(kv[1])):
        print(f"{len(seeds):4d}  {bug}  (seeds {', '.join(map(str, seeds[:8]))}{', ...' if len(seeds) > 8 else ''})")
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
        return classify(args.classify, args.known)
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
    seeds_known, rules = load_known(args.known)
    known = {(e["oracle"], e["seed"]): e for e in seeds_known}
    start = time.monotonic()
    lines, records, failed = [], [], False
    counts = {"a": [0, 0, 0], "b": [0, 0, 0]}  # run, clean, known
    with tempfile.TemporaryDirectory(prefix="parity-gen-") as workdir:
        for oracle in ("a", "b"):
            todo = [s for o, s in work if o == oracle]
            for b0 in range(0, len(todo), BATCH):
                if args.budget_s and time.monotonic() - start > args.budget_s:
                    _log(f"==> budget of {args.budget_s:.0f} s spent: stopping before seed {todo[b0]}")
                    break
                programs = [generator.generate(s, oracle) for s in todo[b0:b0 + BATCH]]
                verdicts = evaluate(programs, oracle, pythons, workdir, f"{oracle}{b0}")
                for prog in programs:
                    n, v = generator.name(prog), verdicts[generator.name(prog)]
                    entry = known.get((oracle, prog["seed"]))
                    counts[oracle][0] += 1
                    rec = {"name": n, "oracle": oracle, "seed": prog["seed"], "program": prog}
                    if v is None and entry is None:
                        counts[oracle][1] += 1
                        line = f"PASS {n}"
                    elif v is None:
                        line, failed = f"FIXED {n}: known failure {entry['bug']!r} no longer fails: update known.json", True
                    elif entry is not None and v[0] == entry["signature"]:
                        counts[oracle][2] += 1
                        line = f"KNOWN {n}: {v[0]} ({entry['bug']}; {entry['script']})"
                    elif entry is None and matching_rule(prog, v[0], rules):
                        counts[oracle][2] += 1
                        rule = matching_rule(prog, v[0], rules)
                        line = f"KNOWN {n}: {v[0]}: {v[1][:160]} ({rule['bug']})"
                    else:
                        failed = True
                        line = f"FAIL {n}: {v[0]}: {v[1]}"
                        rec["signature"], rec["detail"] = v
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
    summary = "GENERATED: " + "; ".join(
        f"oracle {o}: {c[1]}/{c[0]} clean, {c[2]} known, {c[0] - c[1] - c[2]} failing" for o, c in counts.items() if c[0]
    ) + f" in {seconds} s"
    print(summary, flush=True)
    os.makedirs(args.results, exist_ok=True)
    with open(os.path.join(args.results, "gen-last.json"), "w") as f:
        json.dump({"command": shlex.join([os.path.relpath(sys.argv[0]), *(argv or sys.argv[1:])]),
                   "summary": summary, "seconds": seconds, "programs": records}, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
