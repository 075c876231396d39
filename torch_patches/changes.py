"""The what-changes table: per patch, the files it touches, the public names it adds, whether
code that calls no new API can see it, and its PR.

Everything but the visibility column is read from the series itself (``series``, the patch
files and ``manifest.ini``), so the table is regenerated, never edited: ``python -m
torch_patches changes`` prints it and ``test/tools/test_docs_changes.py`` compares it with
``docs/what-changes.md``. Whether non-users can see a patch is a judgement, kept beside the
series in ``changes.ini`` (:data:`CHANGES_NAME`): one line per patch, keyed like the
manifest's ``[trackers]`` by a fragment of the patch's file name::

    [visible]
    Add-the-FSDPPolicy-value-type = no | new names only
    Reset-FSDP-after-metadata-inference = yes | a pipeline step's first microbatch ...

A patch without an entry is an error (:func:`table` raises, naming it), so a new patch is
caught by the test until its line is written.
"""

from __future__ import annotations

import configparser
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from .errors import TorchPatchesError
from .series import Patch, Series

CHANGES_NAME = "changes.ini"
#: Where the generated table lives in a checkout, and the command that writes it.
DOC = "docs/what-changes.md"
COMMAND = "python -m torch_patches changes -o docs/what-changes.md"

_PREFIX_RE = re.compile(r"^\[[^\]]+\]\s*")
_HUNK_CLASS_RE = re.compile(r"^@@ [^@]* @@\s*class (\w+)")
_DEF_RE = re.compile(r"^\+( {0,4})def ([a-z]\w*)\(")
_CLASS_RE = re.compile(r"^\+class ([A-Z]\w*)\b")


@dataclass(frozen=True)
class Visibility:
    """One ``[visible]`` line: ``yes`` or ``no``, and why."""

    key: str
    visible: bool
    why: str


def read_visibility(directory: Path) -> Dict[str, Visibility]:
    """The ``[visible]`` section of ``directory/changes.ini`` (empty if the file is absent)."""
    path = Path(directory) / CHANGES_NAME
    if not path.is_file():
        return {}
    parser = configparser.ConfigParser(interpolation=None, comment_prefixes=("#",), inline_comment_prefixes=None)
    parser.optionxform = str  # type: ignore[assignment,method-assign]  # keys are file-name fragments
    try:
        parser.read(path, encoding="utf-8")
    except configparser.Error as exc:
        raise TorchPatchesError(f"{path}: {exc}")
    out = {}
    for key, value in (parser["visible"].items() if parser.has_section("visible") else ()):
        answer, _, why = value.partition("|")
        if answer.strip() not in ("yes", "no"):
            raise TorchPatchesError(f"{path}: [visible] {key} = {value!r}: the value starts with `yes` or `no`")
        out[key] = Visibility(key, answer.strip() == "yes", why.strip())
    return out


def visibility_of(patch: Patch, entries: Dict[str, Visibility]) -> Optional[Visibility]:
    """The entry whose key is a fragment of ``patch``'s file name (case-insensitive); an error
    when several match."""
    found = [v for k, v in entries.items() if k.lower() in patch.name.lower()]
    if len(found) > 1:
        raise TorchPatchesError(f"{patch.name} matches several [visible] keys in {CHANGES_NAME}: "
                                f"{', '.join(v.key for v in found)}; make one longer")
    return found[0] if found else None


def missing_entries(series: Series) -> List[str]:
    """The patches of ``series`` that have no ``[visible]`` line."""
    entries = read_visibility(series.directory)
    return [p.name for p in series.patches if visibility_of(p, entries) is None]


def added_names(patch: Patch) -> List[str]:
    """Public ``def``/``class`` names the patch adds (and does not remove elsewhere): a method
    as ``Class.name`` when its hunk header names the class."""
    added: List[str] = []
    removed = set()
    cls = None
    for line in patch.data.decode("utf-8", "replace").splitlines():
        if line.startswith("diff --git "):
            cls = None
        m = _HUNK_CLASS_RE.match(line)
        if m:
            cls = m.group(1)
        elif line.startswith("@@"):
            cls = None
        m = _CLASS_RE.match(line)
        if m:
            cls = m.group(1)
            added.append(m.group(1))
            continue
        m = _DEF_RE.match(line)
        if m:
            name = m.group(2)
            added.append(f"{cls}.{name}" if m.group(1) and cls else name)
        elif line.startswith("-") and not line.startswith("---"):
            m = re.match(r"^-\s*(?:def|class) (\w+)", line)
            if m:
                removed.add(m.group(1))
    return list(dict.fromkeys(n for n in added if n.rsplit(".", 1)[-1] not in removed))


def _short(path: str) -> str:
    return path.replace("torch/distributed/", "", 1)


def _pr(patch: Patch, series: Series) -> str:
    from .upstream.export import group_series
    for group in group_series(series):
        if patch in group.patches:
            if group.number:
                return f"pytorch/pytorch#{group.number}"
            note = re.sub(r"^none yet\s*", "", patch.dep3.get("Bug", "").strip()).strip("() ")
            return f"own PR `{group.key}`" + (f" ({note})" if note else "")
    return "?"


def rows(series: Series) -> List[Tuple[str, str, str, str, str]]:
    """One row per patch: patch, files, what it adds or changes, visible to non-users, PR."""
    entries = read_visibility(series.directory)
    missing = [p.name for p in series.patches if visibility_of(p, entries) is None]
    if missing:
        raise TorchPatchesError(
            f"no [visible] line in {Path(series.directory) / CHANGES_NAME} for: {', '.join(missing)}. Add "
            "`FRAGMENT-OF-THE-FILE-NAME = yes | why` (code that calls no new API can see the change) or "
            "`= no | why`")
    out = []
    for patch in series.patches:
        vis = visibility_of(patch, entries)
        assert vis is not None
        names = added_names(patch)
        what = _PREFIX_RE.sub("", patch.subject)
        if names:
            what += "; adds " + ", ".join(f"`{n}`" for n in names)
        files = "<br>".join(f"`{_short(p)}`" for p in patch.paths)
        out.append((f"{patch.name[:4]}", files, what, ("yes: " if vis.visible else "no: ") + vis.why,
                    _pr(patch, series)))
    return out


def render(series: Series) -> str:
    """The Markdown page: a generated-by line and the table."""
    lines = [
        "# What each patch changes",
        "",
        f"Generated from the series (revision {series.revision}, {len(series.patches)} patches): its `series` file,",
        f"the patch files, `manifest.ini` and `{CHANGES_NAME}`, by `{COMMAND}`.",
        "Do not edit it by hand: `test/tools/test_docs_changes.py` regenerates it and fails when it",
        f"differs, or when a patch in `series` has no line in `{CHANGES_NAME}` (the visibility column).",
        "",
        "\"Visible to non-users\": can code that calls none of the new APIs observe the patch",
        "(collectives, gradients, exceptions, public state)? The default-parity harness measures it:",
        "[parity.md](parity.md) and `tools/parity/allowlist.json` list each visible difference.",
        "",
        "| patch | file(s) | public name or behaviour it adds or changes | visible to non-users | PR |",
        "|---|---|---|---|---|",
    ]
    for row in rows(series):
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |")
    return "\n".join(lines) + "\n"
