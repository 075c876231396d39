"""Default parity: runs the scenario catalogue on a pristine torch 2.15.0 (twice)
and on a patched torch (once) and compares everything each rank observed.

    python tools/parity/runner.py --pristine-python PY --patched-python PY [-k PATTERN] [--list]

Prints ``SAME <name>``, ``DIFF <name>: <first difference>`` (or ``NONDET`` when
the pristine torch differs from itself) per scenario and ``PARITY: k/n
scenarios identical``. Exits 1 on a nondeterministic scenario, on a difference
that ``allowlist.json`` does not allow (an entry names the kinds of observation
that may differ, ``may_differ``; everything else is still compared, against
2.15.0 or against the scenario's float64 reference), or on a ``STALE`` entry
(a difference it names stopped appearing). Writes the comparison and the raw observations under
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


#: What an allowlist entry may let differ (``may_differ``), by event kind. Everything else is
#: compared as without an entry; see docs/parity.md, "The allowlist".
KINDS = {
    "collectives": "the collectives and P2P calls (kind, sizes, order, count)",
    "rounding": "numbers (gradients, parameters, losses, outputs) by their summation order only: "
                "compared by value within a tolerance instead of by bits",
    "numbers": "2.15.0's numbers, which are wrong: the patched torch's are compared with the scenario's "
               "float64 reference instead (its 'ref' records must all be 'ok')",
    "state": "public state (sharded or not, gradients present) and pipeline flags",
    "exceptions": "exceptions raised and calls that returned",
    "warnings": "Python warnings and torch log records",
    "outcome": "the outcome of the scenario or of a rank (e.g. TIMEOUT on 2.15.0): the patched torch's "
               "observations are then judged by its reference records alone",
}
EVENT_KIND = {"coll": "collectives", "grads": "numbers", "params": "numbers", "tensor": "numbers",
              "state": "state", "flags": "state", "fsdp_state": "state", "exception": "exceptions", "uncaught": "exceptions",
              "ok": "exceptions", "warning": "warnings", "log": "warnings"}
RTOL = 1e-4  # of the tensor's l2 norm times sqrt(numel): summation order, not a changed number


def load_allowlist(path: str) -> list:
    """Entries ``{"scenario": name or glob, "reason", "patch", "may_differ": [kinds]}``, all required;
    optionally ``"collectives_pinned": {scenario: {collective: count}}`` (see ``compare_allowing``)."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        data = json.load(f)
    entries = data.get("entries", []) if isinstance(data, dict) else data
    for entry in entries:
        missing = [k for k in ("scenario", "reason", "patch", "may_differ") if not entry.get(k)
                   or (isinstance(entry.get(k), str) and not entry[k].strip())]
        if missing:
            raise ValueError(f"allowlist entry {entry.get('scenario', entry)!r} lacks {', '.join(missing)}")
        unknown = [k for k in entry["may_differ"] if k not in KINDS]
        if unknown:
            raise ValueError(f"allowlist entry {entry['scenario']!r}: may_differ {unknown} not among {sorted(KINDS)}")
        if "rounding" in entry["may_differ"] and "numbers" in entry["may_differ"]:
            raise ValueError(f"allowlist entry {entry['scenario']!r}: 'numbers' already compares with the reference")
        pins = entry.get("collectives_pinned")
        if pins is not None:
            if "collectives" not in entry["may_differ"]:
                raise ValueError(f"allowlist entry {entry['scenario']!r}: collectives_pinned without 'collectives' "
                                 "in may_differ")
            for name, counts in pins.items():
                if not fnmatch.fnmatchcase(name, entry["scenario"]):
                    raise ValueError(f"allowlist entry {entry['scenario']!r}: pinned scenario {name!r} does not match it")
                if not isinstance(counts, dict) or not all(isinstance(v, int) and v >= 0 for v in counts.values()):
                    raise ValueError(f"allowlist entry {entry['scenario']!r}: pin of {name!r} must map collectives "
                                     "to counts")
    return entries


def collective_totals(obs: dict) -> dict:
    """Collective and P2P calls of an observation by function, summed over its ranks."""
    total = collections.Counter()
    for r in (obs or {}).get("ranks", []):
        total += _collective_counts(_canon(r.get("events", [])))
    return dict(sorted(total.items()))


def pin_collectives(entries: list, raws: list) -> tuple:
    """``(pinned, varying)``: pins each scenario that an entry allowing ``collectives`` matches to
    the patched torch's collective totals in ``raws`` (worker results of the same torch), if they
    agree in every run; ``varying`` lists the scenarios whose totals differ between runs, which
    stay unpinned, as do those an entry lists in ``collectives_unpinned`` (scenario: why its calls
    may vary, e.g. which sends a rank posts before a failure reaches it). Changes ``entries`` in
    place."""
    names = [n for n in raws[0]["results"] if all(n in r["results"] for r in raws[1:])]
    pinned, varying = 0, []
    for entry in entries:
        if "collectives" not in entry["may_differ"]:
            continue
        pins = {}
        for name in names:
            if not fnmatch.fnmatchcase(name, entry["scenario"]) or allowlisted(name, entries) is not entry:
                continue
            if name in entry.get("collectives_unpinned", {}):  # {scenario: why its calls may vary}
                continue
            totals = [collective_totals(r["results"][name]) for r in raws]
            if all(t == totals[0] for t in totals[1:]):
                pins[name] = totals[0]
            else:
                varying.append(name)
        if pins:
            entry["collectives_pinned"] = pins
            pinned += len(pins)
        else:
            entry.pop("collectives_pinned", None)
    return pinned, varying


def allowlisted(name: str, entries: list):
    return next((e for e in entries if fnmatch.fnmatchcase(name, e["scenario"])), None)


def _close(pa, pb, digest) -> bool:
    """Two fingerprints (worker.tensor_print) equal within RTOL; ``digest`` gives the shape."""
    if pa is None or pb is None:
        return pa is pb
    numel = 1
    for d in re.findall(r"\d+", digest.split(":", 1)[0]):
        numel *= int(d)
    tol = RTOL * max(pa[1], pb[1]) * max(1.0, numel) ** 0.5 + 1e-7
    return all(abs(x - y) <= tol for x, y in zip(pa, pb))


def _shape(digest) -> str:
    return digest.rsplit(":", 1)[0] if isinstance(digest, str) and digest != "None" else digest


def _numbers_close(x, y) -> bool:
    """Numeric events equal by value within tolerance: same labels, shapes, dtypes and None-ness."""
    if x[0] != y[0] or len(x) != len(y) or len(x) < 3:
        return False
    if x[0] == "tensor":
        return x[1] == y[1] and _shape(x[2]) == _shape(y[2]) and (x[2] == y[2] or _close(x[3], y[3], x[2]))
    da, db, pa, pb = x[1], y[1], x[2], y[2]
    if set(da) != set(db):
        return False
    return all(da[k] == db[k] or (_shape(da[k]) == _shape(db[k]) and _close(pa.get(k), pb.get(k), da[k]))
               for k in da)


def _kind(event) -> str:
    return EVENT_KIND.get(event[0], "other") if event else "other"


def kinds_differing(a: dict, b: dict) -> list:
    """Which kinds of observation differ between two observations, in KINDS order."""
    out = set()
    if a.get("outcome") != b.get("outcome"):
        out.add("outcome")
    for ra, rb in zip(a.get("ranks", []), b.get("ranks", [])):
        if ra.get("outcome") != rb.get("outcome"):
            out.add("outcome")
        ea, eb = _canon(ra.get("events", [])), _canon(rb.get("events", []))
        for kind in ("collectives", "state", "exceptions", "warnings"):
            if [e for e in ea if _kind(e) == kind] != [e for e in eb if _kind(e) == kind]:
                out.add(kind)
        na, nb = [e for e in ea if _kind(e) == "numbers"], [e for e in eb if _kind(e) == "numbers"]
        refs_a = [e for e in ea if e and e[0] == "ref"]
        if na != nb:
            close = len(na) == len(nb) and all(_numbers_close(x, y) for x, y in zip(na, nb))
            out.add("rounding" if close else "numbers")
        if any(e[2] != "ok" for e in refs_a):
            out.add("numbers")
    if len(a.get("ranks", [])) != len(b.get("ranks", [])):
        out.add("outcome")
    return [k for k in KINDS if k in out]


def compare_allowing(a: dict, b: dict, entry: dict, name: str = None):
    """The first difference between 2.15.0's observation ``a`` and the patched ``b`` that ``entry``
    does not allow, or None: the allowed kinds are left out of both event streams, numbers compare
    within tolerance under ``rounding``, and under ``numbers`` the patched torch's reference records
    must all be ``ok`` (and exist). Where the entry pins scenario ``name``'s collectives
    (``collectives_pinned``), the patched torch's totals per collective must equal the pin: the
    entry allows that intended difference, not any other."""
    allowed = set(entry["may_differ"])
    if a is None or b is None:
        return "missing on the " + ("pristine" if a is None else "patched") + " side"
    pin = entry.get("collectives_pinned", {}).get(name) if "collectives" in allowed else None
    if pin is not None:
        totals = collective_totals(b)
        moved = [f"{k} {totals.get(k, 0)} (pinned {pin.get(k, 0)})" for k in sorted(set(pin) | set(totals))
                 if totals.get(k, 0) != pin.get(k, 0)]
        if moved:
            return ("the patched torch's collectives moved from the ones this entry pins (all ranks): "
                    + ", ".join(moved) + "; a change of the intended difference itself, find which")
    ranks_b = b.get("ranks", [])
    if "numbers" in allowed:
        refs = [(rank, e) for rank, r in enumerate(ranks_b) for e in r.get("events", []) if e and e[0] == "ref"]
        if not refs:
            return "the entry lets 2.15.0's numbers differ, but the scenario records no float64 reference"
        open_refs = set(entry.get("open", {}).get("refs", []))
        bad = [(rank, e) for rank, e in refs if e[2] != "ok" and e[1] not in open_refs]
        if bad:
            rank, e = bad[0]
            return f"rank {rank}: the patched torch misses the float64 reference at {e[1]!r}: {e[2]}"
    outcomes_differ = a.get("outcome") != b.get("outcome") or any(
        ra.get("outcome") != rb.get("outcome") for ra, rb in zip(a.get("ranks", []), ranks_b))
    if outcomes_differ:
        if "outcome" not in allowed:
            return compare(a, b) or "outcome differs"
        if "numbers" not in allowed:
            return "the outcome differs and the entry gives no reference to judge the patched torch by"
        bad = [rank for rank, r in enumerate(ranks_b) if r.get("outcome") != "ok"] if b.get("outcome") == "done" \
            else ["all"]
        return f"the patched torch's rank {bad[0]} did not finish ({b.get('outcome')})" if bad else None
    if len(a.get("ranks", [])) != len(ranks_b):
        return f"{len(a.get('ranks', []))} vs {len(ranks_b)} ranks"
    drop = {k for k in allowed if k in ("collectives", "state", "exceptions", "warnings")}
    if "numbers" in allowed:
        drop.add("numbers")
    for rank, (ra, rb) in enumerate(zip(a.get("ranks", []), ranks_b)):
        ea = [e for e in _canon(ra.get("events", [])) if _kind(e) not in drop and not ("numbers" in allowed and e
                                                                                      and e[0] == "ref")]
        eb = [e for e in _canon(rb.get("events", [])) if _kind(e) not in drop and not ("numbers" in allowed and e
                                                                                      and e[0] == "ref")]
        for i in range(max(len(ea), len(eb))):
            x = ea[i] if i < len(ea) else None
            y = eb[i] if i < len(eb) else None
            if x == y:
                continue
            if x is not None and y is not None and "rounding" in allowed and _kind(x) == "numbers" \
                    and _numbers_close(x, y):
                continue
            what = f"{_event_diff(x, y)}"
            if x is not None and y is not None and _kind(x) == "numbers" and x[0] == y[0] and len(x) > 2:
                what += " (beyond rounding)" if "rounding" in allowed else " (bitwise)"
            return f"rank {rank} {_kind(x or y)} event {i} of those compared (after {_last_phase(ea, i)!r}): {what}"
    return None


def evaluate(pristine_runs: list, patched: dict, entries: list):
    """``(lines, summary, failed)`` for raw worker results (``{"results": {name: obs}}``).

    An allowlisted scenario is judged by ``compare_allowing``: only the kinds its entry names may
    differ. An entry is STALE when a kind it names differs in none of the scenarios it matched, or
    a scenario it matches is identical: the intended difference stopped appearing."""
    base = pristine_runs[0]["results"]
    names = list(base) + [n for n in patched["results"] if n not in base]
    lines, summary = [], {}
    failed = False
    identical = 0
    seen: dict = {}  # entry scenario pattern -> {"entry", "names", "kinds"}
    for name in names:
        nondet = None
        for other in pristine_runs[1:] if name in base else []:
            nondet = compare(base.get(name), other["results"].get(name))
            if nondet:
                break
        a, b = base.get(name), patched["results"].get(name)
        diff = compare(a, b)
        entry = allowlisted(name, entries)
        if entry is not None:
            use = seen.setdefault(entry["scenario"], {"entry": entry, "names": [], "kinds": set(), "open": set()})
            use["names"].append(name)
        if nondet:
            status, text = "NONDET", nondet
            failed = True
        elif diff and entry is None:
            status, text = "DIFF", diff
            failed = True
        elif diff:
            differing = kinds_differing(a, b) if a is not None and b is not None else []
            use["kinds"].update(differing)
            beyond = compare_allowing(a, b, entry, name)
            status = "DIFF"
            if beyond:
                failed = True
                text = (f"{beyond} [beyond what the allowlist entry {entry['scenario']!r} ({entry['patch']}) lets "
                        f"differ: {', '.join(entry['may_differ'])}; first difference: {diff}]")
            else:
                text = (f"{diff} (allowlisted: {entry['patch']}: differs in {', '.join(differing) or 'nothing'}; "
                        f"may differ: {', '.join(entry['may_differ'])}; the rest is compared)")
                still_open = open_misses(b, entry)
                use["open"].update(still_open)
                if still_open:
                    text += f" OPEN: misses the reference at {', '.join(sorted(still_open))}: {entry['open']['bug']}"
        else:
            status, text = "SAME", None
            identical += 1
            if entry is not None:
                status, text = "STALE", (f"identical to 2.15.0, but allowlisted ({entry['patch']}) for a difference "
                                         f"in {', '.join(entry['may_differ'])}: that difference stopped appearing "
                                         f"(the intended change is lost, or 2.15.0's side changed): find which")
                failed = True
        lines.append(f"{status} {name}" + (f": {text}" if text else ""))
        summary[name] = {"status": status, "difference": text}
    for pattern, use in seen.items():
        missing = [k for k in use["entry"]["may_differ"] if k not in use["kinds"]]
        if use["kinds"] and missing:
            failed = True
            lines.append(f"STALE {pattern}: allowlisted ({use['entry']['patch']}) for a difference in "
                         f"{', '.join(use['entry']['may_differ'])}, but {', '.join(missing)} no longer differ"
                         f"{'s' if len(missing) == 1 else ''} in any of its {len(use['names'])} scenario(s) "
                         f"({', '.join(use['names'][:4])}{', ...' if len(use['names']) > 4 else ''}): what stopped "
                         f"appearing: {'; '.join(KINDS[k] for k in missing)}; find which change removed it")
        gone = [r for r in use["entry"].get("open", {}).get("refs", []) if r not in use["open"]]
        if use["kinds"] and gone:
            failed = True
            lines.append(f"STALE {pattern}: its open bug no longer shows: the patched torch now equals the float64 "
                         f"reference at {', '.join(gone)} ({use['entry']['open']['bug']}); record the fix in the "
                         f"entry's open field")
    lines.append(f"PARITY: {identical}/{len(names)} scenarios identical")
    return lines, summary, failed


def open_misses(obs: dict, entry: dict) -> set:
    """The reference labels of ``entry``'s open bug that the patched observation misses."""
    labels = set(entry.get("open", {}).get("refs", []))
    return {e[1] for r in (obs or {}).get("ranks", []) for e in r.get("events", [])
            if e and e[0] == "ref" and e[2] != "ok" and e[1] in labels}


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
    parser.add_argument("--pin-collectives", nargs="+", metavar="RAW",
                        help="pin, in the allowlist, the collectives of the allowlisted scenarios to those of "
                             "these patched worker results (e.g. results/raw-patched.json and a second run's); "
                             "runs nothing else")
    args = parser.parse_args(argv)
    if args.pin_collectives:
        entries = load_allowlist(args.allowlist)
        raws = []
        for path in args.pin_collectives:
            with open(path) as f:
                raws.append(json.load(f))
        pinned, varying = pin_collectives(entries, raws)
        with open(args.allowlist) as f:
            data = json.load(f)
        data["entries"] = entries
        with open(args.allowlist, "w") as f:
            json.dump(data, f, indent=1)
            f.write("\n")
        print(f"pinned the collectives of {pinned} scenario(s) in {args.allowlist}; left unpinned (they vary "
              f"between the {len(raws)} runs): {', '.join(varying) or 'none'}")
        return 0
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
