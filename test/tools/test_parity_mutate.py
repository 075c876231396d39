"""The mutation check tools/parity/mutate.py: its committed mutants and its mechanics (applying a
mutant to a hard-linked copy of a fake venv and undoing it, refusing a target that is missing or
ambiguous), without starting torch."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PARITY = REPO / "tools" / "parity"
SERIES = REPO / "torch_patches" / "patches" / "2.15.0"
sys.path.insert(0, str(PARITY))


def _load(name):
    spec = importlib.util.spec_from_file_location(name, PARITY / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


mutate = _load("mutate")

TARGET = "torch/distributed/x.py"
ORIGINAL = "def f(a):\n    b = a + 1\n    return b\n\n\ndef g(a):\n    return a * 2\n"
PATCH = f"""From: x
Subject: [PATCH] x

diff --git a/{TARGET} b/{TARGET}
--- a/{TARGET}
+++ b/{TARGET}
@@ -1,2 +1,3 @@
 def f(a):
+    b = a + 1
+    return b
"""


@pytest.fixture
def fake(tmp_path):
    """A fake venv with one torch file, and a series directory with a patch that adds two of its lines."""
    site = tmp_path / "venv" / "lib" / "python3.11" / "site-packages"
    (site / "torch" / "distributed" / "__pycache__").mkdir(parents=True)
    (site / TARGET).write_text(ORIGINAL)
    (site / "torch" / "distributed" / "__pycache__" / "x.cpython-311.pyc").write_bytes(b"stale")
    (tmp_path / "venv" / "bin").mkdir()
    series = tmp_path / "series"
    series.mkdir()
    (series / "0001-x.patch").write_text(PATCH)
    return tmp_path / "venv", series


def _mutant(**kw):
    m = {"id": "m1", "patch": "0001", "file": TARGET, "find": "    b = a + 1\n", "replace": "    b = a - 1\n",
         "description": "off by two"}
    m.update(kw)
    return m


def test_committed_mutants_cover_every_runtime_patch():
    mutants = mutate.load_mutants()
    assert len(mutants) >= 31
    covered = {m["patch"][:4] for m in mutants}
    # Every patch that changes runtime code (0001 and 0009 change none), 0025-0027 of revision 5 too
    runtime = {f"{n:04d}" for n in [*range(2, 9), *range(10, 28)]}
    assert runtime <= covered, sorted(runtime - covered)
    for m in mutants:
        mutate.check_in_patch(m)  # the changed lines are lines that the named patch adds
        assert m["tests"]["files"] and all((REPO / f).is_file() for f in m["tests"]["files"]), m["id"]
        assert m["gen"].get("family") in ("fsdp", "pp", None) and set(m["gen"]["oracles"]) <= {"a", "b"}
        assert len(m["find"].splitlines()) <= 6 and m["description"].endswith(".")


def test_list_prints_every_mutant(tmp_path):
    # --list checks each mutant's target in the venv: point it at an empty one to see the refusals
    venv = tmp_path / "venv"
    (venv / "lib" / "python3.11" / "site-packages").mkdir(parents=True)
    out = subprocess.run([sys.executable, str(PARITY / "mutate.py"), "--list", "--venv", str(venv)],
                         capture_output=True, text=True)
    assert out.returncode == 1  # no torch files in that venv
    for m in mutate.load_mutants():
        assert m["id"] in out.stdout


def test_apply_and_unapply_on_a_hard_linked_copy(fake, tmp_path):
    venv, series = fake
    mutant = _mutant()
    mutate.check_in_patch(mutant, str(series))
    copy = mutate.make_copy(str(venv), str(tmp_path / "copy"))
    orig_file = Path(mutate.site_packages(str(venv))) / TARGET
    copy_file = Path(mutate.site_packages(copy)) / TARGET
    assert os.path.samefile(orig_file, copy_file)  # cp -al: the same inode
    mutate.apply(mutant, copy, str(venv))
    assert "b = a - 1" in copy_file.read_text()
    assert orig_file.read_text() == ORIGINAL  # never written through the link
    assert not os.path.samefile(orig_file, copy_file)
    assert not list(copy_file.parent.glob("__pycache__/x.*.pyc"))  # the copy's stale bytecode is gone
    assert (orig_file.parent / "__pycache__" / "x.cpython-311.pyc").read_bytes() == b"stale"
    mutate.unapply(mutant, copy, str(venv))
    assert os.path.samefile(orig_file, copy_file) and copy_file.read_text() == ORIGINAL


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"find": "    c = 3\n"}, "not found"),
        ({"find": "(a", "replace": "(x"}, "found 2 times"),
        ({"replace": "    b = (a\n"}, "does not compile"),
    ],
)
def test_refuses_a_target_that_moved(fake, tmp_path, kw, message):
    venv, _ = fake
    copy = mutate.make_copy(str(venv), str(tmp_path / "copy"))
    with pytest.raises(mutate.MutantError, match=message):
        mutate.apply(_mutant(**kw), copy, str(venv))
    assert (Path(mutate.site_packages(copy)) / TARGET).read_text() == ORIGINAL


def test_refuses_a_change_outside_the_patch(fake):
    _, series = fake
    with pytest.raises(mutate.MutantError, match="does not add"):
        mutate.check_in_patch(_mutant(find="    return a * 2\n", replace="    return a * 3\n"), str(series))
    # an inserted line next to an added one is a change of that hunk
    mutate.check_in_patch(_mutant(find="    return b\n", replace="    return b\n    b = 0\n"), str(series))


def test_generator_seeds_restricted_to_family_and_oracle():
    seeds = mutate.gen_seeds({"oracles": ["b"], "family": "pp", "extra": [["b", 88]]},
                             str(PARITY / "seeds.json"))
    assert list(seeds) == ["b"] and 88 in seeds["b"]
    assert all(mutate.generator.generate(s, "b")["family"] == "pp" for s in seeds["b"])
    both = mutate.gen_seeds({"oracles": ["a", "b"]}, str(PARITY / "seeds.json"))
    ci = json.loads((PARITY / "seeds.json").read_text())["sets"]["ci"]
    for oracle in ("a", "b"):  # the CI set, each seed once
        want = set(range(*ci[oracle]["range"])) | set(ci[oracle]["seeds"])
        assert sorted(both[oracle]) == sorted(want), oracle


def test_results_table_and_two_checks(tmp_path):
    mutants = [_mutant(id="m1"), _mutant(id="m2")]
    killed = {"verdict": "killed", "seconds": 3.0}
    rows = [{"id": "m1", "patch": "0001", "description": "a. b", "checks": {"tests": killed, "gen": killed}},
            {"id": "m2", "patch": "0001", "description": "c", "checks": {"tests": killed}}]
    path = tmp_path / "r.json"
    data = mutate.merge_results(str(path), rows, {"command": "x", "date": "d", "series": "s"}, mutants)
    assert [mutate.killed_twice(r) for r in data["mutants"]] == [True, False]
    # a later --only run updates one check of one row
    again = mutate.merge_results(str(path), [{"id": "m2", "patch": "0001", "description": "c",
                                               "checks": {"parity": killed}}], data, mutants)
    assert set(again["mutants"][1]["checks"]) == {"tests", "parity"} and mutate.killed_twice(again["mutants"][1])
    assert "by a test and the generator or parity: 2/2" in mutate.table(again)
    doc = tmp_path / "parity.md"
    doc.write_text("# x\n")
    mutate.render_docs(again, str(doc))
    mutate.render_docs(again, str(doc))
    assert doc.read_text().count(mutate.BEGIN) == 1 and "| `m2` |" in doc.read_text()
    assert json.loads(path.read_text())["mutants"][0]["id"] == "m1"
