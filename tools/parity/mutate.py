"""Mutation check: one-line regressions of the series' own hunks, and which checks kill them.

    python tools/parity/mutate.py --list
    python tools/parity/mutate.py [--only ID ...] [--checks tests,gen,parity] [--venv VENV]
        [--pristine-python PY] [--results FILE] [--docs]

Each mutant of ``mutants.json`` names a patch of the series, a file of the
patched torch, an exact text of a hunk that patch adds (found exactly once in
the patched file) and its replacement, and the regression it models. For each
mutant the check makes a hard-linked copy of the patched venv (``cp -al VENV
COPY``, once per run), replaces the one mutated file in the copy by rename (the
copy's directory entry is unlinked first, so the file of ``VENV`` is never
written), and runs against that copy's interpreter:

- ``tests``: the mutant's test files (``pytest -x``, its ``-k`` if given;
  default: the ``[trackers]`` test files of its patch in manifest.ini);
- ``gen``: the generator's CI seed set (``seeds.json`` set ``ci``) restricted
  to the mutant's oracles and program family, plus its extra seeds, through
  ``generate.py`` with ``known.json`` as in CI; the first ``FAIL`` or
  ``FIXED`` line kills the mutant and stops the run;
- ``parity``: the catalogue scenarios matching its ``-k`` patterns, with
  ``allowlist.json`` as in CI. The pristine torch's observations are made once
  per run and pattern set; the unmutated series' too, so that a mutant whose
  observations differ from the unmutated series' but which parity passes
  (allowlisted, or equal to pristine where the series differs) is reported as
  ``masked``.

A check kills a mutant when it fails (exit 1, a ``FAIL``, a timeout); a
mutant is ``killed twice`` when a test and the generator or parity kill it.
Prints one row per mutant, writes the results to ``docs/mutants.json``
(merged by mutant id with the file's earlier rows, so ``--only`` reruns
update it) and, with ``--docs``, renders the table into docs/parity.md.
Standard library only, plus the project's ``torch_patches``. Not part of
``.ci/run``: it starts a test file, a generator run and a catalogue run per
mutant.
"""

import argparse
import datetime
import glob
import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(0, REPO)

import generator  # noqa: E402
import runner  # noqa: E402

MUTANTS = os.path.join(HERE, "mutants.json")
RESULTS = os.path.join(REPO, "docs", "mutants.json")
DOCS = os.path.join(REPO, "docs", "parity.md")
SERIES_DIR = os.path.join(REPO, "torch_patches", "patches", "2.15.0")
CHECKS = ("tests", "gen", "parity")
FIELDS = ("id", "patch", "file", "find", "replace", "description")
BEGIN, END = "<!-- mutants:begin -->", "<!-- mutants:end -->"


class MutantError(Exception):
    """A mutant that cannot be applied to this series (its target text moved)."""


def _log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


# -- the mutants -------------------------------------------------------------
def load_mutants(path: str = MUTANTS) -> list:
    """The mutants of ``path``, each checked for its fields and unique id."""
    with open(path) as f:
        mutants = json.load(f)["mutants"]
    seen = set()
    for m in mutants:
        missing = [k for k in FIELDS if k not in m]
        if missing:
            raise MutantError(f"mutant {m.get('id', m)!r} lacks {', '.join(missing)}")
        if m["id"] in seen:
            raise MutantError(f"mutant id {m['id']!r} is used twice")
        if m["find"] == m["replace"]:
            raise MutantError(f"mutant {m['id']}: the replacement equals the target text")
        seen.add(m["id"])
    return mutants


def patch_path(mutant: dict, series_dir: str = SERIES_DIR) -> str:
    """The series' patch file that ``mutant["patch"]`` names (a file name or its number prefix)."""
    names = [n for n in sorted(os.listdir(series_dir)) if n.endswith(".patch") and n.startswith(mutant["patch"])]
    if len(names) != 1:
        raise MutantError(f"mutant {mutant['id']}: patch {mutant['patch']!r} names {len(names)} patches of "
                          f"{series_dir}")
    return os.path.join(series_dir, names[0])


def added_lines(patch_file: str, path: str) -> set:
    """The lines (stripped) that ``patch_file`` adds to ``path``."""
    out, current = set(), None
    with open(patch_file, encoding="utf-8") as f:
        for line in f:
            if line.startswith("+++ "):
                current = line[4:].strip()
                current = current[2:] if current.startswith("b/") else current
            elif line.startswith("diff --git"):
                current = None
            elif current == path and line.startswith("+"):
                out.add(line[1:].strip())
    return out


def check_in_patch(mutant: dict, series_dir: str = SERIES_DIR) -> None:
    """Raise unless the mutant changes only lines that its patch adds: every line of the target
    text that the replacement drops or changes (for a pure insertion, some line of the target)."""
    # A patch whose lines a later patch rewrote names that patch in ``lines_from``
    owner = {**mutant, "patch": mutant.get("lines_from", mutant["patch"])}
    added = added_lines(patch_path(owner, series_dir), mutant["file"])
    kept = set(mutant["replace"].splitlines())
    lines = [ln for ln in mutant["find"].splitlines() if ln.strip()]
    changed = [ln for ln in lines if ln not in kept] or lines
    foreign = [ln.strip() for ln in changed if ln.strip() not in added]
    if len(foreign) == len(changed) or (foreign and changed is not lines):
        raise MutantError(f"mutant {mutant['id']}: {os.path.basename(patch_path(owner, series_dir))} does not add "
                          f"{foreign[0]!r} to {mutant['file']} (the series changed? update {MUTANTS})")


def site_packages(venv: str) -> str:
    found = sorted(glob.glob(os.path.join(venv, "lib", "python3*", "site-packages")))
    if not found:
        raise MutantError(f"no lib/python3*/site-packages in {venv}")
    return found[0]


def _drop_bytecode(path: str) -> None:
    stem = os.path.splitext(os.path.basename(path))[0]
    for pyc in glob.glob(os.path.join(os.path.dirname(path), "__pycache__", f"{stem}.*.pyc")):
        os.unlink(pyc)  # the copy's link only; the original's bytecode stays


def mutated_text(mutant: dict, text: str) -> str:
    """``text`` with the mutant's target replaced; raises unless the target occurs exactly once."""
    count = text.count(mutant["find"])
    if count != 1:
        where = "not found" if count == 0 else f"found {count} times"
        raise MutantError(f"mutant {mutant['id']}: its target text is {where} in {mutant['file']} "
                          f"(the series changed? update {MUTANTS}): {mutant['find'].strip()[:80]!r}")
    new = text.replace(mutant["find"], mutant["replace"])
    try:
        compile(new, mutant["file"], "exec")
    except SyntaxError as exc:
        raise MutantError(f"mutant {mutant['id']}: the mutated {mutant['file']} does not compile: {exc}")
    return new


def apply(mutant: dict, copy: str, original: str) -> None:
    """Mutate ``copy`` (a hard-linked copy of the venv ``original``): the file is replaced by
    rename, so ``original``'s file (the same inode before) is never written."""
    path = os.path.join(site_packages(copy), mutant["file"])
    with open(path, encoding="utf-8") as f:
        new = mutated_text(mutant, f.read())
    tmp = path + ".mutant"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(new)
    shutil.copymode(path, tmp)
    os.replace(tmp, path)
    _drop_bytecode(path)
    orig = os.path.join(site_packages(original), mutant["file"])
    if os.path.samefile(orig, path):
        raise AssertionError(f"{path} is still {orig} after the mutation")


def unapply(mutant: dict, copy: str, original: str) -> None:
    """Undo :func:`apply`: link ``original``'s file into ``copy`` again (by rename)."""
    path = os.path.join(site_packages(copy), mutant["file"])
    orig = os.path.join(site_packages(original), mutant["file"])
    tmp = path + ".mutant"
    if os.path.lexists(tmp):
        os.unlink(tmp)
    os.link(orig, tmp)
    os.replace(tmp, path)
    _drop_bytecode(path)


def make_copy(venv: str, dest: str) -> str:
    """``cp -al venv dest``; returns ``dest``."""
    subprocess.run(["cp", "-al", venv, dest], check=True)
    return dest


# -- the checks --------------------------------------------------------------
def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _run(cmd: list, timeout_s: float, stop=None, env=None, cwd=REPO) -> tuple:
    """``(returncode or "TIMEOUT" or "STOPPED", output, seconds)``; ``stop(line)`` true ends the run."""
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    lines, status = [], None
    deadline = t0 + timeout_s
    try:
        import selectors
        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ)
        while True:
            if time.monotonic() > deadline:
                status = "TIMEOUT"
                break
            if not sel.select(timeout=1.0):
                if proc.poll() is not None:
                    break
                continue
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if stop is not None and stop(line):
                status = "STOPPED"
                break
    finally:
        if status is not None:
            _kill(proc)
        proc.wait()
        proc.stdout.close()
    return (status or proc.returncode), "".join(lines), round(time.monotonic() - t0, 1)


def test_files(mutant: dict) -> list:
    """The mutant's test files, or its patch's ``[trackers]`` test files."""
    tests = mutant.get("tests", {})
    if tests.get("files"):
        return list(tests["files"])
    from torch_patches.series import read_manifest
    from torch_patches.upstream.export import tracker_number
    from torch_patches.series import parse_patch
    path = patch_path(mutant)
    with open(path, "rb") as f:
        patch = parse_patch(os.path.basename(path), f.read())
    tracker = read_manifest(SERIES_DIR).tracker(tracker_number(patch), patch.name)
    return list(tracker.tests) if tracker else []


def check_tests(mutant: dict, python: str, timeout_s: float, use_k: bool = True) -> dict:
    files = test_files(mutant)
    if not files:
        return {"verdict": "none", "detail": "no test file"}
    cmd = [python, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *files]
    if use_k and mutant.get("tests", {}).get("k"):
        cmd += ["-k", mutant["tests"]["k"]]
    rc, out, secs = _run(cmd, timeout_s)
    failed = re.findall(r"^FAILED (\S+)", out, re.M)
    last = [ln for ln in out.splitlines() if ln.strip()][-1:] or [""]
    res = {"seconds": secs, "command": shlex.join(["pytest", "-x", *cmd[6:]])}
    if rc == 0:
        res.update(verdict="survived", detail=last[0][:200])
    elif rc == 1 or rc == "TIMEOUT":
        res.update(verdict="killed", detail=(failed[0] if failed else str(rc)) + f" ({last[0][:160]})")
    else:
        res.update(verdict="error", detail=f"pytest exit {rc}: {last[0][:200]}")
    return res


def gen_seeds(spec: dict, seeds_file: str) -> dict:
    """The CI seed set restricted to ``spec``'s oracles and family, plus its extra seeds: ``{oracle: [seeds]}``."""
    from generate import seed_set
    oracles = spec.get("oracles", ["a", "b"])
    family = spec.get("family")
    out = {}
    for oracle, seed in seed_set("ci", seeds_file) + [tuple(x) for x in spec.get("extra", [])]:
        if oracle not in oracles or seed in out.get(oracle, []):
            continue
        if family and generator.generate(seed, oracle)["family"] != family:
            continue
        out.setdefault(oracle, []).append(seed)
    return out


def gen_key(spec: dict) -> str:
    """The baseline key of a generator spec: its oracles and family (``b/pp``)."""
    return "".join(sorted(spec.get("oracles", ["a", "b"]))) + "/" + (spec.get("family") or "both")


def check_gen(mutant: dict, python: str, pristine: str, workdir: str, timeout_s: float) -> dict:
    spec = mutant.get("gen")
    if not spec:
        return {"verdict": "none", "detail": "no generator set"}
    seeds = gen_seeds(spec, os.path.join(HERE, "seeds.json"))
    path = os.path.join(workdir, f"seeds-{mutant['id']}.json")
    with open(path, "w") as f:
        json.dump({"sets": {"mutant": {o: {"seeds": s} for o, s in seeds.items()}}}, f)
    results = os.path.join(workdir, f"gen-{mutant['id']}")
    cmd = [python, os.path.join(HERE, "generate.py"), "--set", "mutant", "--seeds-file", path,
           "--patched-python", python, "--results", results]
    if "a" in seeds:
        cmd += ["--pristine-python", pristine]
    rc, out, secs = _run(cmd, timeout_s, stop=lambda ln: ln.startswith(("FAIL ", "FIXED ")))
    what = ", ".join(f"{o}: {len(s)}" for o, s in sorted(seeds.items()))
    res = {"seconds": secs, "programs": what, "family": spec.get("family") or "both", "set": gen_key(spec)}
    first = next((ln for ln in out.splitlines() if ln.startswith(("FAIL ", "FIXED "))), None)
    summary = next((ln for ln in out.splitlines() if ln.startswith("GENERATED:")), "")
    known = [ln.split(":")[0].split()[1] for ln in out.splitlines() if ln.startswith("KNOWN ")]
    res["known"] = known
    if first:
        res.update(verdict="killed", detail=first[:240])
    elif rc == "TIMEOUT":
        res.update(verdict="killed", detail=f"timeout after {timeout_s:.0f} s")
    elif rc == 0:
        res.update(verdict="survived", detail=summary)
    else:
        res.update(verdict="error", detail=f"generate.py exit {rc}: {out.strip().splitlines()[-1:]}")
    return res


def _parity_run(python: str, patterns: list, out: str) -> dict:
    return runner.run_workers([("mutate", python, out)], patterns, 1)[0]


def _cached_run(python: str, patterns: list, workdir: str, label: str) -> dict:
    key = hashlib.sha1(json.dumps([label, patterns]).encode()).hexdigest()[:12]
    path = os.path.join(workdir, f"parity-{label}-{key}.json")
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    _log(f"    parity: {label} observations of -k {' -k '.join(patterns)}")
    return _parity_run(python, patterns, path)


def check_parity(mutant: dict, python: str, pythons: dict, workdir: str) -> dict:
    patterns = mutant.get("parity") or []
    if not patterns:
        return {"verdict": "none", "detail": "no scenario"}
    t0 = time.monotonic()
    pristine = _cached_run(pythons["pristine"], patterns, workdir, "pristine")
    series = _cached_run(pythons["series"], patterns, workdir, "series")
    try:
        patched = _parity_run(python, patterns, os.path.join(workdir, f"parity-{mutant['id']}.json"))
    except SystemExit as exc:  # the worker itself failed
        return {"verdict": "killed", "detail": str(exc), "seconds": round(time.monotonic() - t0, 1)}
    lines, _, failed = runner.evaluate([pristine], patched, runner.load_allowlist(runner.ALLOWLIST))
    changed = [n for n in series["results"] if runner.compare(series["results"][n], patched["results"].get(n))]
    res = {"seconds": round(time.monotonic() - t0, 1), "scenarios": len(patched["results"]),
           "changed": changed, "summary": lines[-1]}
    bad = next((ln for ln in lines if ln.startswith(("DIFF", "STALE", "NONDET")) and "(allowlisted" not in ln), None)
    if failed:
        res.update(verdict="killed", detail=(bad or lines[-1])[:240])
    elif changed:
        res.update(verdict="masked", detail=f"{len(changed)} scenario(s) observe other than the series, "
                                            f"all passed: {', '.join(changed[:3])}")
    else:
        res.update(verdict="survived", detail=lines[-1])
    return res


# -- results -----------------------------------------------------------------
def killed_twice(row: dict) -> bool:
    c = row.get("checks", {})
    return c.get("tests", {}).get("verdict") == "killed" and any(
        c.get(k, {}).get("verdict") == "killed" for k in ("gen", "parity"))


def _cell(res: dict, baseline: dict = None) -> str:
    if not res:
        return "not run"
    v = res.get("verdict", "?")
    if "seconds" not in res:
        return v
    known = ""
    if res.get("known") and res.get("verdict") != "killed":
        base = (baseline or {}).get(res.get("set", ""), {}).get("known")
        known = f"; {len(res['known'])} known" + ("" if base is None else f", {len(set(base))} unmutated")
    return f"{v} ({res['seconds']:.0f} s{known})"


def row_line(row: dict) -> str:
    c = row.get("checks", {})
    return f"{row['id']:<34} " + " | ".join(f"{k} {_cell(c.get(k))}" for k in CHECKS) + (
        "  => killed twice" if killed_twice(row) else "")


def table(data: dict) -> str:
    rows = ["| mutant | patch | regression | tests | generator | parity | two checks |", "|---|---|---|---|---|---|---|"]
    for r in data["mutants"]:
        c = r.get("checks", {})
        rows.append(f"| `{r['id']}` | {r['patch'][:4]} | {r['description'].split('. ')[0].rstrip('.')} | "
                    + " | ".join(_cell(c.get(k), data.get("baseline")) for k in CHECKS) + f" | {'yes' if killed_twice(r) else 'no'} |")
    n = len(data["mutants"])
    twice = sum(killed_twice(r) for r in data["mutants"])
    per = {k: sum(r.get("checks", {}).get(k, {}).get("verdict") == "killed" for r in data["mutants"]) for k in CHECKS}
    rows.append("")
    rows.append(f"Killed by tests {per['tests']}/{n}, by the generator {per['gen']}/{n}, by parity "
                f"{per['parity']}/{n}; by a test and the generator or parity: {twice}/{n}.")
    return "\n".join(rows)


def render_docs(data: dict, path: str = DOCS) -> None:
    with open(path, encoding="utf-8") as f:
        text = f.read()
    block = (f"{BEGIN}\nLast run: `{data['command']}` ({data['date']}, {data['series']}).\n\n"
             f"{table(data)}\n{END}")
    if BEGIN in text and END in text:
        text = text[:text.index(BEGIN)] + block + text[text.index(END) + len(END):]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def merge_results(path: str, rows: list, meta: dict, mutants: list) -> dict:
    """The results file with ``rows`` replacing earlier rows of the same id, in mutants.json order."""
    old, extra = {}, {}
    if os.path.exists(path):
        with open(path) as f:
            earlier = json.load(f)
        old = {r["id"]: r for r in earlier.get("mutants", [])}
        extra = {k: v for k, v in earlier.items() if k not in ("mutants", *meta)}
    for r in rows:
        if r["id"] in old and "checks" in old[r["id"]]:
            r["checks"] = {**old[r["id"]]["checks"], **r["checks"]}
        old[r["id"]] = r
    order = [m["id"] for m in mutants]
    data = {**extra, **meta, "mutants": [old[i] for i in order if i in old] + [r for i, r in old.items() if i not in order]}
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    return data


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="list the mutants and check that each applies")
    parser.add_argument("--only", action="append", default=[], help="run this mutant (repeatable; prefix)")
    parser.add_argument("--checks", default=",".join(CHECKS), help="comma-separated subset of tests,gen,parity")
    parser.add_argument("--venv", default=os.environ.get("VENV", os.path.join(REPO, ".venv")),
                        help="the patched venv (never written; default .venv)")
    parser.add_argument("--pristine-python", default=os.environ.get("PARITY_PRISTINE_PYTHON"),
                        help="pristine torch 2.15.0 (default: a reverted hard-linked copy of --venv)")
    parser.add_argument("--mutants", default=MUTANTS)
    parser.add_argument("--results", default=RESULTS)
    parser.add_argument("--workdir", help="for the venv copies and caches (default: a temporary directory)")
    parser.add_argument("--timeout-s", type=float, default=1500, help="per check")
    parser.add_argument("--docs", action="store_true", help="render the results table into docs/parity.md")
    parser.add_argument("--no-k", action="store_true", help="run the mutants' whole test files (ignore their -k)")
    parser.add_argument("--baseline", action="store_true",
                        help="run the chosen mutants' generator sets on the unmutated series instead (KNOWN counts)")
    args = parser.parse_args(argv)
    checks = [c for c in args.checks.split(",") if c]
    if any(c not in CHECKS for c in checks):
        parser.error(f"--checks takes {','.join(CHECKS)}")
    mutants = load_mutants(args.mutants)
    chosen = [m for m in mutants if not args.only or any(m["id"].startswith(o) for o in args.only)]
    if not chosen:
        parser.error(f"no mutant matches {args.only}")
    venv = os.path.abspath(args.venv)
    status = 0
    if args.list:
        site = site_packages(venv)
        for m in chosen:
            try:
                check_in_patch(m)
                with open(os.path.join(site, m["file"]), encoding="utf-8") as f:
                    mutated_text(m, f.read())
                ok = "ok"
            except (MutantError, OSError) as exc:
                ok, status = f"REFUSED: {exc}", 1
            print(f"{m['id']:<34} {m['patch'][:4]} {m['file'].rsplit('/', 1)[-1]:<16} {ok}\n    {m['description']}")
        return status
    for m in chosen:  # refuse before starting anything
        check_in_patch(m)
        with open(os.path.join(site_packages(venv), m["file"]), encoding="utf-8") as f:
            mutated_text(m, f.read())
    workdir = args.workdir or tempfile.mkdtemp(prefix="mutate-")
    os.makedirs(workdir, exist_ok=True)
    copy = os.path.join(workdir, "venv-mutant")
    if os.path.exists(copy):
        shutil.rmtree(copy)
    _log(f"==> cp -al {venv} {copy}")
    make_copy(venv, copy)
    pristine = args.pristine_python
    if not pristine and ("parity" in checks or "gen" in checks):
        pcopy = os.path.join(workdir, "venv-pristine")
        if not os.path.exists(pcopy):
            _log(f"==> cp -al {venv} {pcopy}, then revert the series")
            make_copy(venv, pcopy)
            subprocess.run([os.path.join(pcopy, "bin", "python"), "-m", "torch_patches", "revert", "--python",
                            os.path.join(pcopy, "bin", "python")], cwd=REPO, check=True,
                           env={**os.environ, "PYTHONPATH": REPO}, stdout=subprocess.DEVNULL)
        pristine = os.path.join(pcopy, "bin", "python")
    if args.baseline:
        return run_baseline(chosen, venv, pristine, workdir, args)
    python = os.path.join(copy, "bin", "python")
    pythons = {"pristine": pristine, "series": os.path.join(venv, "bin", "python")}
    rows = []
    meta = {"command": "python tools/parity/mutate.py" + (" " + shlex.join(argv or sys.argv[1:]) if (argv or sys.argv[1:]) else ""),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "series": _series_label(venv)}
    for i, m in enumerate(chosen):
        _log(f"==> [{i + 1}/{len(chosen)}] {m['id']} ({m['patch'][:4]}): {m['description'].split('.')[0]}")
        apply(m, copy, venv)
        row = {k: m[k] for k in ("id", "patch", "file", "description")}
        row["checks"] = {}
        try:
            for check in checks:
                if check == "tests":
                    res = check_tests(m, python, args.timeout_s, use_k=not args.no_k)
                elif check == "gen":
                    res = check_gen(m, python, pristine, workdir, args.timeout_s)
                else:
                    res = check_parity(m, python, pythons, workdir)
                row["checks"][check] = res
                _log(f"    {check}: {res['verdict']} {res.get('seconds', '')} {res.get('detail', '')[:160]}")
        finally:
            unapply(m, copy, venv)
        row["run"] = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        rows.append(row)
        data = merge_results(args.results, [row], meta, mutants)  # after each mutant: a long run can stop
        print(row_line(next(r for r in data["mutants"] if r["id"] == row["id"])), flush=True)
        if args.docs:
            render_docs(data)
    if not args.workdir:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


def run_baseline(chosen: list, venv: str, pristine: str, workdir: str, args) -> int:
    """The chosen mutants' generator sets (with every extra seed) on the unmutated series: which
    programs print ``KNOWN`` there, so that a mutant's ``KNOWN`` programs can be compared."""
    specs = {}
    for m in chosen:
        if m.get("gen"):
            spec = specs.setdefault(gen_key(m["gen"]), {**m["gen"], "extra": []})
            spec["extra"] = spec["extra"] + [e for e in m["gen"].get("extra", []) if e not in spec["extra"]]
    baseline = {}
    for key, spec in sorted(specs.items()):
        _log(f"==> baseline {key}")
        res = check_gen({"id": "baseline-" + key.replace("/", "-"), "gen": spec}, os.path.join(venv, "bin", "python"),
                        pristine, workdir, args.timeout_s)
        res["run"] = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        baseline[key] = res
        print(f"baseline {key}: {res['verdict']} ({res.get('seconds')} s) {res.get('detail', '')[:160]}", flush=True)
    data = {}
    if os.path.exists(args.results):
        with open(args.results) as f:
            data = json.load(f)
    data["baseline"] = {**data.get("baseline", {}), **baseline}
    with open(args.results, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    if args.docs and data.get("mutants"):
        render_docs(data)
    return 0


def _series_label(venv: str) -> str:
    from torch_patches.series import read_manifest
    return f"series revision {read_manifest(SERIES_DIR).revision}"


if __name__ == "__main__":
    sys.exit(main())
