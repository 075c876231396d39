"""Default parity: runs the scenario catalogue on a pristine torch 2.15.0 (twice)
and on a patched torch (once) and compares everything each rank observed.

    python tools/parity/runner.py --pristine-python PY --patched-python PY [-k PATTERN] [--list]

Prints ``SAME <name>``, ``DIFF <name>: <first difference>`` (or ``NONDET`` when
the pristine torch differs from itself) per scenario and ``PARITY: k/n
scenarios identical``. Exits 1 on a nondeterministic scenario, on a difference
that ``allowlist.json`` does not list, or on an allowlist entry whose scenario
is identical (remove it). Writes the comparison and the raw observations under
``results/`` (``--results DIR``). Standard library only: torch is imported by
``worker.py`` in the child processes.
"""

import argparse
import collections
import fnmatch
import json
import os
import re
import shlex
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "worker.py")
ALLOWLIST = os.path.join(HERE, "allowlist.json")
MAX_SHOWN = 240


#: Transport failures of gloo (a peer that timed out or closed first): which of
#: them a rank sees, and its wording, depends on timing, not on behaviour.
GLOO_FAILURE = re.compile(r"gloo/transport|pair closure|Connection closed by peer|Timed out waiting .* for (recv|send)")


def _canon(value):
    if isinstance(value, str):
        return "<gloo transport failure>" if GLOO_FAILURE.search(value) else value
    if isinstance(value, list):
        return [_canon(v) for v in value]
    if isinstance(value, dict):
        return {k: _canon(v) for k, v in value.items()}
    return value


def _short(value) -> str:
    text = json.dumps(value, sort_keys=True) if not isinstance(value, str) else value
    return text if len(text) <= MAX_SHOWN else text[:MAX_SHOWN] + "..."


def _event_diff(a, b) -> str:
    """How two events differ, naming the key for dict payloads (gradients, parameters, state)."""
    if a is None or b is None:
        return f"{_short(a)} vs {_short(b)}"
    if a[:1] == b[:1] and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y and isinstance(x, dict) and isinstance(y, dict):
                keys = sorted(set(x) | set(y))
                k = next(k for k in keys if x.get(k) != y.get(k))
                return f"{a[0]}[{k}]: {_short(x.get(k, '<missing>'))} vs {_short(y.get(k, '<missing>'))}"
    return f"{_short(a)} vs {_short(b)}"


def _collective_counts(events) -> collections.Counter:
    return collections.Counter(e[1] for e in events if e and e[0] == "coll")


def _last_phase(events, upto) -> str:
    for e in reversed(events[:upto]):
        if e and e[0] == "phase":
            return e[1]
    return "start"


NUMBERS = ("grads", "params", "tensor")


def _exceptions(events) -> list:
    return [f"{e[1]}: {e[2][:100]}" for e in events if e and e[0] in ("exception", "uncaught")]


def _numbers(events) -> list:
    out, phase = [], "start"
    for e in events:
        if e and e[0] == "phase":
            phase = e[1]
        elif e and e[0] in NUMBERS:
            out.append((phase, e))
    return out


def summarise(a: dict, b: dict) -> str:
    """Beyond the first difference: collective counts over all ranks, exceptions
    seen on one side only, and the first phase whose numbers differ."""
    parts = []
    ca, cb = collections.Counter(), collections.Counter()
    exc_a, exc_b = [], []
    first_numbers = None
    for ra, rb in zip(a.get("ranks", []), b.get("ranks", [])):
        ea, eb = _canon(ra.get("events", [])), _canon(rb.get("events", []))
        ca += _collective_counts(ea)
        cb += _collective_counts(eb)
        exc_a += _exceptions(ea)
        exc_b += _exceptions(eb)
        if first_numbers is None:
            for (pa, xa), (_, xb) in zip(_numbers(ea), _numbers(eb)):
                if xa != xb:
                    first_numbers = pa
                    break
    deltas = [f"{k} {ca[k]} vs {cb[k]}" for k in sorted(set(ca) | set(cb)) if ca[k] != cb[k]]
    if deltas:
        parts.append("all ranks' collectives: " + ", ".join(deltas))
    only_b = [e for e in dict.fromkeys(exc_b) if e not in exc_a]
    only_a = [e for e in dict.fromkeys(exc_a) if e not in exc_b]
    if only_b:
        parts.append(f"raised only on the patched torch: {only_b[0]!r}" + (f" (+{len(only_b) - 1})" if len(only_b) > 1 else ""))
    if only_a:
        parts.append(f"raised only on the pristine torch: {only_a[0]!r}" + (f" (+{len(only_a) - 1})" if len(only_a) > 1 else ""))
    if first_numbers is not None:
        parts.append(f"numbers differ from {first_numbers!r}")
    return "; ".join(parts)


def compare(a: dict, b: dict):
    """The first difference between two observations of one scenario, or None."""
    if a is None or b is None:
        return "missing on the " + ("pristine" if a is None else "patched") + " side"
    if a.get("outcome") != b.get("outcome"):
        return f"outcome {a.get('outcome')} vs {b.get('outcome')}"
    ranks_a, ranks_b = a.get("ranks", []), b.get("ranks", [])
    if len(ranks_a) != len(ranks_b):
        return f"{len(ranks_a)} vs {len(ranks_b)} ranks"
    for rank, (ra, rb) in enumerate(zip(ranks_a, ranks_b)):
        ea, eb = _canon(ra.get("events", [])), _canon(rb.get("events", []))
        for i in range(max(len(ea), len(eb))):
            x = ea[i] if i < len(ea) else None
            y = eb[i] if i < len(eb) else None
            if x != y:
                where = f"rank {rank} event {i} (after {_last_phase(ea, i)!r})"
                text = f"{where}: {_event_diff(x, y)}"
                extra = summarise(a, b)
                return text + (f" [{extra}]" if extra else "")
        if ra.get("outcome") != rb.get("outcome"):
            return f"rank {rank} outcome {ra.get('outcome')} vs {rb.get('outcome')}"
    return None


def load_allowlist(path: str) -> list:
    """Entries ``{"scenario": name or glob, "reason": ..., "patch": ...}``, all three required."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        data = json.load(f)
    entries = data.get("entries", []) if isinstance(data, dict) else data
    for entry in entries:
        missing = [k for k in ("scenario", "reason", "patch") if not str(entry.get(k, "")).strip()]
        if missing:
            raise ValueError(f"allowlist entry {entry!r} lacks {', '.join(missing)}")
    return entries


def allowlisted(name: str, entries: list):
    return next((e for e in entries if fnmatch.fnmatchcase(name, e["scenario"])), None)


def evaluate(pristine_runs: list, patched: dict, entries: list):
    """``(lines, summary, failed)`` for raw worker results (``{"results": {name: obs}}``)."""
    base = pristine_runs[0]["results"]
    names = list(base) + [n for n in patched["results"] if n not in base]
    lines, summary = [], {}
    failed = False
    identical = 0
    used = set()
    for name in names:
        nondet = None
        for other in pristine_runs[1:] if name in base else []:
            nondet = compare(base.get(name), other["results"].get(name))
            if nondet:
                break
        diff = compare(base.get(name), patched["results"].get(name))
        entry = allowlisted(name, entries)
        if nondet:
            status, text = "NONDET", nondet
            failed = True
        elif diff:
            status, text = "DIFF", diff
            if entry is not None:
                used.add(entry["scenario"])
                text += f" (allowlisted: {entry['patch']}: {entry['reason']})"
            else:
                failed = True
        else:
            status, text = "SAME", None
            identical += 1
            if entry is not None:
                used.add(entry["scenario"])
                status, text = "STALE", f"identical but allowlisted ({entry['patch']}): remove the entry"
                failed = True
        lines.append(f"{status} {name}" + (f": {text}" if text else ""))
        summary[name] = {"status": status, "difference": text}
    lines.append(f"PARITY: {identical}/{len(names)} scenarios identical")
    return lines, summary, failed


def run_workers(runs: list, patterns: list, jobs: int) -> list:
    """Runs ``(label, python, out)`` workers, ``jobs`` at a time; returns their results in order."""
    pending = list(enumerate(runs))
    active: dict = {}
    results: list = [None] * len(runs)
    while pending or active:
        while pending and len(active) < max(1, jobs):
            i, (label, python, out) = pending.pop(0)
            cmd = [python, WORKER, "--out", out, "--progress", "50"] + [x for p in patterns for x in ("-k", p)]
            print(f"==> {label}: {shlex.join(cmd)}", file=sys.stderr, flush=True)
            active[i] = (subprocess.Popen(cmd, cwd=HERE), time.monotonic())
        for i, (proc, t0) in list(active.items()):
            if proc.poll() is None:
                continue
            del active[i]
            label, _, out = runs[i]
            if proc.returncode != 0:
                raise SystemExit(f"parity: the {label} worker failed (exit {proc.returncode})")
            with open(out) as f:
                data = json.load(f)
            data["meta"]["wall_seconds"] = round(time.monotonic() - t0, 2)
            data["meta"]["label"] = label
            print(f"    {label}: {data['meta']['scenarios']} scenarios in {data['meta']['wall_seconds']} s "
                  f"(torch {data['meta']['torch']})", file=sys.stderr, flush=True)
            results[i] = data
        time.sleep(0.2)
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pristine-python", required=True)
    parser.add_argument("--patched-python", required=True)
    parser.add_argument("-k", dest="patterns", action="append", default=[],
                        help="only scenarios whose name contains this (repeatable)")
    parser.add_argument("--list", action="store_true", help="list the scenarios and exit")
    parser.add_argument("--pristine-runs", type=int, default=2,
                        help="runs on the pristine torch (2: the determinism check)")
    parser.add_argument("--jobs", type=int, default=1,
                        help="torches run at the same time (each forks its scenario's ranks)")
    parser.add_argument("--results", default=os.path.join(HERE, "results"))
    parser.add_argument("--allowlist", default=ALLOWLIST)
    args = parser.parse_args(argv)
    if args.list:
        cmd = [args.patched_python, WORKER, "--list"] + [x for p in args.patterns for x in ("-k", p)]
        return subprocess.run(cmd, cwd=HERE).returncode
    entries = load_allowlist(args.allowlist)
    os.makedirs(args.results, exist_ok=True)
    runs = [(f"pristine run {i + 1}", args.pristine_python, os.path.join(args.results, f"raw-pristine-{i + 1}.json"))
            for i in range(max(1, args.pristine_runs))]
    runs.insert(1, ("patched run", args.patched_python, os.path.join(args.results, "raw-patched.json")))
    done = run_workers(runs, args.patterns, args.jobs)
    patched = done.pop(1)
    pristine = done
    lines, summary, failed = evaluate(pristine, patched, entries)
    for line in lines:
        print(line, flush=True)
    result = {
        "command": os.environ.get("PARITY_COMMAND") or shlex.join([os.path.relpath(sys.argv[0]), *(argv or sys.argv[1:])]),
        "parity": lines[-1],
        "pristine": [r["meta"] for r in pristine],
        "patched": patched["meta"],
        "allowlist": entries,
        "scenarios": summary,
    }
    with open(os.path.join(args.results, "last.json"), "w") as f:
        json.dump(result, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
