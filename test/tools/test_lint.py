"""Upstream-style lint: the series adds no ruff or mypy warning to the files it touches.

Both tools run on the pristine base torch copies of the touched files and on
the patched copies (the shipped series applied in memory); every warning is
normalised to ``(file, rule code, message)`` without line numbers, and the
patched files may not have more of any than the pristine ones (a multiset
comparison, so a second copy of an existing warning also counts as new).

ruff: the rule selection of pytorch/pytorch's ``pyproject.toml``
(``[tool.ruff.lint]``, line length 88, Python 3.10), reduced to codes the
pinned ruff knows. mypy: the flags of pytorch/pytorch's ``mypy.ini``
(``check_untyped_defs``, ``disallow_untyped_defs``, ``disallow_untyped_decorators``,
``allow_redefinition``, ``local_partial_types``, ``possibly-undefined``,
``warn_redundant_casts``), with each file's own ``# mypy:`` header honoured
(mypy reads it). Only the touched files are checked, with
``--follow-imports=skip --ignore-missing-imports``: following imports type-checks
all of torch (many minutes); skipping makes everything imported from other
modules ``Any``, identically for both copies, so the comparison stays fair but
misses errors that need other modules' types.
"""

import collections
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tooling import load
from torch_patches.series import default_series_dir
from torch_patches.state import apply_series

RUFF_CONFIG = """\
line-length = 88
target-version = "py310"

[lint]
select = [
    "B", "B904", "C4", "G", "E", "EXE", "F", "SIM", "W", "FURB", "LOG", "NPY", "PERF", "PGH004", "PIE",
    "PLC0131", "PLC0132", "PLC1802", "PLC0205", "PLC3002", "PLC0414", "PLE", "PLR0133", "PLR0206",
    "PLR1722", "PLR1736", "PLW0127", "PLW0129", "PLW0131", "PLW0133", "PLW0245", "PLW0406", "PLW0711",
    "PLW1501", "PLW1507", "PLW1509", "PLW2101", "PLW3301", "PYI", "Q003", "Q004", "RSE", "RUF007",
    "RUF008", "RUF013", "RUF015", "RUF016", "RUF017", "RUF018", "RUF019", "RUF020", "RUF024", "RUF026",
    "RUF030", "RUF033", "RUF041", "RUF048", "RUF100", "S324", "SLOT", "TC", "TRY002", "TRY203", "TRY401",
    "UP", "YTT", "S101",
]
ignore = [
    "B007", "B008", "B017", "B018", "B023", "B028", "E402", "C408", "E501", "E741", "EXE001", "F405",
    "FURB122", "NPY002", "PERF203", "PERF401", "PYI024", "PYI036", "PYI041", "PYI056", "SIM102", "SIM103",
    "SIM112", "SIM105", "SIM108", "SIM110", "SIM114", "SIM116", "SIM117", "SIM300", "TC006", "B905",
]

[lint.per-file-ignores]
"__init__.py" = ["F401"]
"""

MYPY_FLAGS = ["--follow-imports=skip", "--ignore-missing-imports", "--check-untyped-defs",
              "--disallow-untyped-defs", "--disallow-untyped-decorators", "--allow-redefinition",
              "--local-partial-types", "--enable-error-code", "possibly-undefined", "--warn-redundant-casts",
              "--python-version", "3.10", "--explicit-package-bases", "--no-incremental", "--no-error-summary",
              "--show-error-codes", "--no-pretty", "--hide-error-context"]


#: New warnings the series is known to add, listed exactly (file, code, message):
#: any other new warning fails, and an entry that disappears must be removed.
#: Empty: the series adds none.
KNOWN_NEW: dict = {"ruff": set(), "mypy": set()}


def _check(tool, new):
    unexpected = [w for w in new if w not in KNOWN_NEW[tool]]
    assert not unexpected, f"{tool} warnings the series adds:\n" + "\n".join(f"{f}: {c} {m}" for f, c, m in unexpected)
    fixed = KNOWN_NEW[tool] - set(new)
    assert not fixed, f"fixed in the series; remove from KNOWN_NEW[{tool!r}]: {sorted(fixed)}"


def _need(module):
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed (tools/requirements-test.txt pins it)")


@pytest.fixture(scope="module")
def trees(pristine_site, tmp_path_factory):
    """``(pristine dir, patched dir, touched .py paths)`` for the shipped series."""
    series = load(default_series_dir())
    pristine = {p: ((pristine_site / p).read_bytes() if (pristine_site / p).exists() else None)
                for p in series.paths}
    patched = apply_series(series, pristine)
    root = tmp_path_factory.mktemp("lint")
    for name, files in (("pristine", pristine), ("patched", patched)):
        for rel, data in files.items():
            if data is not None:
                (root / name / rel).parent.mkdir(parents=True, exist_ok=True)
                (root / name / rel).write_bytes(data)
        for pkg in ("torch", "torch/distributed"):  # package roots for mypy's module names
            init = root / name / pkg / "__init__.py"
            if not init.exists():
                init.parent.mkdir(parents=True, exist_ok=True)
                init.write_bytes(b"")
    (root / "ruff.toml").write_text(RUFF_CONFIG)
    paths = [p for p in series.paths if p.endswith(".py") and patched.get(p) is not None]
    return root / "pristine", root / "patched", paths


def _warnings(cmd, cwd, paths, pattern):
    proc = subprocess.run([*cmd, *[p for p in paths if (cwd / p).exists()]], cwd=cwd,
                          capture_output=True, text=True)
    found = collections.Counter()
    for line in proc.stdout.splitlines():
        m = re.match(pattern, line)
        if m:
            found[m.group("file"), m.group("code"), m.group("msg").strip()] += 1
    assert proc.returncode in (0, 1), proc.stdout + proc.stderr  # 2: the tool itself failed
    return found


def _new(pristine, patched):
    return sorted((patched - pristine).elements())


def test_ruff_no_new_warnings(trees):
    _need("ruff")
    before, after, paths = trees
    cmd = [sys.executable, "-m", "ruff", "check", "--no-cache", "--config", str(before.parent / "ruff.toml"),
           "--output-format", "concise"]
    pattern = r"^(?P<file>[^:]+):\d+:\d+: (?P<code>[A-Z]+\d+) (?:\[\*\] )?(?P<msg>.*)$"
    new = _new(_warnings(cmd, before, paths, pattern), _warnings(cmd, after, paths, pattern))
    _check("ruff", new)


def test_mypy_no_new_warnings(trees):
    _need("mypy")
    before, after, paths = trees
    cmd = [sys.executable, "-m", "mypy", *MYPY_FLAGS]
    pattern = r"^(?P<file>[^:]+):\d+: error: (?P<msg>.*?)\s+\[(?P<code>[a-z-]+)\]$"
    new = _new(_warnings(cmd, before, paths, pattern), _warnings(cmd, after, paths, pattern))
    _check("mypy", new)


def test_lint_catches_a_new_warning(trees, tmp_path):
    """The comparison itself works: an unused import added to a copy is reported."""
    _need("ruff")
    _, after, paths = trees
    edited = tmp_path / "edited"
    for rel in paths:
        (edited / rel).parent.mkdir(parents=True, exist_ok=True)
        (edited / rel).write_bytes((after / rel).read_bytes())
    (edited / paths[-1]).write_bytes(b"import json\n" + (after / paths[-1]).read_bytes())
    cmd = [sys.executable, "-m", "ruff", "check", "--no-cache", "--config", str(after.parent / "ruff.toml"),
           "--output-format", "concise"]
    pattern = r"^(?P<file>[^:]+):\d+:\d+: (?P<code>[A-Z]+\d+) (?:\[\*\] )?(?P<msg>.*)$"
    new = _new(_warnings(cmd, after, paths, pattern), _warnings(cmd, edited, paths, pattern))
    assert any(code == "F401" for _, code, _ in new), new


def test_requirements_pin_the_linters():
    text = (Path(__file__).resolve().parents[2] / "tools/requirements-test.txt").read_text()
    assert re.search(r"^ruff==\S+$", text, re.MULTILINE) and re.search(r"^mypy==\S+$", text, re.MULTILINE)
