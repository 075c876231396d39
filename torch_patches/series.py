"""A series directory: its ``manifest.ini``, its ``series`` file and the patches.

The directory is the manifest (``torch_patches/patches/<base version>/``)::

    series          one NNNN-slug.patch per line, in order ('#' starts a comment)
    manifest.ini    [base] pin and paths, [docs] file, [series] revision, [trackers] -> tests
    NNNN-*.patch    git format-patch output with DEP-3 fields
    docs/KEY.md     a tracker's docs entries (read by ``export`` only: :func:`read_docs_entries`)

A patch is ``git format-patch`` output: mail headers (``From:``, ``Date:``,
``Subject: [PATCH] [FSDP2] ...``), a commit message carrying the DEP-3
fields (``Bug:``, ``Forwarded:``, ``Last-Update:``), ``---``, and the diffs.
This module is the only reader of ``series`` files (the shipped ones, an
export's, and the ones ``tools/devtree.py`` and the benchmarks read).
"""

from __future__ import annotations

import configparser
import email.header
import hashlib
import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Dict, List, Mapping, Optional, Tuple

from .base import Base
from .errors import PatchFormatError, TorchPatchesError
from .patching import FilePatch, parse_diff

#: Where the shipped series directories live, one per base version.
PATCHES_ROOT = Path(__file__).resolve().parent / "patches"
MANIFEST_NAME = "manifest.ini"
SERIES_NAME = "series"

#: DEP-3 fields every patch of this project carries.
REQUIRED_DEP3 = ("Bug", "Forwarded", "Last-Update")

#: A series entry: ``NNNN-slug.patch``; an export's series nests them as ``DIR/NNNN-slug.patch``.
PATCH_NAME = re.compile(r"^\d{4}-[A-Za-z0-9._-]+\.patch$")
NESTED_PATCH_NAME = re.compile(r"^[A-Za-z0-9._-]+/\d{4}-[A-Za-z0-9._-]+\.patch$")
_DEP3_RE = re.compile(r"^(Description|Origin|Bug(?:-[A-Za-z]+)?|Forwarded|Author|"
                      r"Reviewed-by|Last-Update|Applied-Upstream):\s*(.*)$")


# -- the manifest ---------------------------------------------------------------
@dataclass(frozen=True)
class Tracker:
    """An upstream issue (or a patch without one yet): the PR title prefix and its tests."""

    number: int  # the pytorch/pytorch issue; 0 for a patch without a tracker yet
    prefix: str  # PR title prefix, e.g. "[FSDP2]"
    what: str  # what the PR adds, for the test commit's subject
    tests: Tuple[str, ...] = ()  # repo paths; upstream uses the same paths
    #: For ``number == 0``: a fragment of the patch's file name that picks it (``zero-bubble``).
    match: str = ""

    @property
    def key(self) -> str:
        """The ``[trackers]`` key: the issue number, else the file-name fragment."""
        return str(self.number) if self.number else self.match


@dataclass(frozen=True)
class Manifest:
    """``manifest.ini`` of a series directory."""

    base: Base
    revision: int
    trackers: Tuple[Tracker, ...] = ()
    #: ``[docs] file``: the upstream docs source file the docs entries go into.
    docs_file: str = ""

    def tracker(self, number: int, patch_name: str = "") -> Optional[Tracker]:
        """The line for issue ``number``; for a patch without one (``number == 0``), the
        line whose key is a fragment of ``patch_name`` (case-insensitive)."""
        if number:
            return next((t for t in self.trackers if t.number == number), None)
        return next((t for t in self.trackers if t.match and t.match.lower() in patch_name.lower()), None)


def read_manifest(directory: os.PathLike) -> Manifest:
    """Parse ``directory/manifest.ini`` (standard library ``configparser``)."""
    path = Path(directory) / MANIFEST_NAME
    parser = configparser.ConfigParser(interpolation=None, comment_prefixes=("#",),
                                       inline_comment_prefixes=None)
    parser.optionxform = str  # type: ignore[assignment,method-assign]  # keys are issue numbers or name fragments
    try:
        with open(path, encoding="utf-8") as fh:
            parser.read_file(fh)
        section = parser["base"]
        base = Base(version=section["version"].strip(), git_version=section["git_version"].strip(),
                    prefixes=tuple(section.get("prefixes", "").split()),
                    packaged=tuple(section.get("packaged", "torch/").split()),
                    local_label=parser.get("series", "local_label", fallback="fsdp").strip())
        revision = parser.getint("series", "revision")
        docs_file = parser.get("docs", "file", fallback="").strip()
        trackers = []
        for key, value in (parser["trackers"].items() if parser.has_section("trackers") else []):
            prefix, what, tests = (part.strip() for part in (value.split("|") + ["", ""])[:3])
            number = int(key) if key.isdigit() else 0
            trackers.append(Tracker(number, prefix, what, tuple(tests.split()), "" if number else key))
    except FileNotFoundError:
        raise TorchPatchesError(f"no {MANIFEST_NAME} in {directory}: a series directory holds "
                                f"{SERIES_NAME}, {MANIFEST_NAME} and the patches")
    except (configparser.Error, KeyError, ValueError) as exc:
        raise TorchPatchesError(f"{path}: {exc}")
    return Manifest(base=base, revision=revision, trackers=tuple(trackers), docs_file=docs_file)


def shipped_series_dirs(root: Path = PATCHES_ROOT) -> List[Path]:
    """The series directories under ``root`` (one per base version), oldest base first."""
    dirs = [d for d in root.iterdir() if (d / MANIFEST_NAME).is_file()] if root.is_dir() else []
    return sorted(dirs, key=lambda d: tuple(int(x) if x.isdigit() else -1 for x in d.name.split(".")))


def default_series_dir(base_version: Optional[str] = None, root: Path = PATCHES_ROOT) -> Path:
    """The shipped series for ``base_version`` (a target's torch), else the newest base's."""
    dirs = shipped_series_dirs(root)
    if not dirs:
        raise TorchPatchesError(f"no series directory (with {MANIFEST_NAME}) under {root}")
    if base_version is not None:
        for d in dirs:
            if read_manifest(d).base.version == base_version:
                return d
    return dirs[-1]


# -- docs entries ----------------------------------------------------------------
DOCS_DIR = "docs"
_ANCHOR_RE = re.compile(r"^(after|before): (.*\S)\s*$")


@dataclass(frozen=True)
class DocsEntry:
    """A snippet for the ``[docs] file``, and where it goes."""

    where: str  # "after" or "before"
    anchor: str  # a line of the docs file (compared without surrounding whitespace)
    snippet: str  # the text to insert, ending with one newline
    source: str = ""  # the entry file, for messages


def parse_docs_entries(text: str, where: str = "") -> Tuple[DocsEntry, ...]:
    """Parse a docs entry file.

    The file is one or more entries. An entry starts with a line
    ``after: LINE`` or ``before: LINE`` at column 0, where ``LINE`` is a line
    of the docs file (e.g. ``.. autoclass:: FSDPModule``); the lines up to the
    next such line are its snippet (surrounding blank lines dropped). The
    snippet goes after (before) the block holding ``LINE``: the fenced block
    (```` ``` ````) around it, else its paragraph. The first non-blank line
    must be an anchor line; a snippet line cannot start with ``after: `` or
    ``before: ``.
    """
    entries: List[Tuple[str, str, int, List[str]]] = []
    for lineno, line in enumerate(text.splitlines(), 1):
        m = _ANCHOR_RE.match(line)
        if m:
            entries.append((m.group(1), m.group(2).strip(), lineno, []))
        elif entries:
            entries[-1][3].append(line)
        elif line.strip():
            raise TorchPatchesError(f"{where}:{lineno}: expected `after: LINE` or `before: LINE` "
                                    f"(the line of the docs file the snippet goes after/before), got {line!r}")
    if not entries:
        raise TorchPatchesError(f"{where}: no `after: LINE` / `before: LINE` entry")
    out = []
    for kind, anchor, lineno, lines in entries:
        snippet = "\n".join(lines).strip("\n")
        if not snippet.strip():
            raise TorchPatchesError(f"{where}:{lineno}: `{kind}: {anchor}` has no snippet")
        out.append(DocsEntry(kind, anchor, snippet + "\n", where))
    return tuple(out)


def read_docs_entries(directory: os.PathLike) -> Dict[str, Tuple[DocsEntry, ...]]:
    """``{tracker key: entries}`` from ``directory/docs/<key>.md`` (``{}`` without ``docs/``).

    Only ``export`` reads them: an installed torch and a wheel have no docs.
    """
    docs = Path(directory) / DOCS_DIR
    if not docs.is_dir():
        return {}
    return {path.stem: parse_docs_entries(path.read_text(encoding="utf-8"), str(path))
            for path in sorted(docs.glob("*.md"))}


# -- the series file --------------------------------------------------------------
@dataclass(frozen=True)
class SeriesFile:
    """A ``series`` file: its leading comment block and the entries."""

    header: Tuple[str, ...]
    names: Tuple[str, ...]


def read_series_file(path: os.PathLike, pattern: "re.Pattern[str]" = PATCH_NAME) -> SeriesFile:
    """Parse a ``series`` file: ``#`` starts a comment, blank lines are skipped,
    every entry must match ``pattern`` and appear once."""
    path = Path(path)
    if path.is_dir():
        path = path / SERIES_NAME
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise TorchPatchesError(f"no series file at {path}")
    header: List[str] = []
    names: List[str] = []
    for lineno, raw in enumerate(text.splitlines(), 1):
        if raw.startswith("#") and not names:
            header.append(raw)
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if not pattern.match(line):
            raise TorchPatchesError(f"{path}:{lineno}: expected a NNNN-slug.patch name, got {line!r}")
        if line in names:
            raise TorchPatchesError(f"{path}:{lineno}: {line} is listed twice")
        names.append(line)
    return SeriesFile(tuple(header), tuple(names))


def write_series_file(directory: Path, header, names) -> None:
    """Write ``directory/series`` (the header lines, then one name per line)."""
    (Path(directory) / SERIES_NAME).write_text("".join(line + "\n" for line in (*header, *names)),
                                               encoding="utf-8")


# -- patches --------------------------------------------------------------------------
@dataclass(frozen=True)
class Patch:
    """One patch file of the series."""

    name: str
    data: bytes = field(repr=False)
    subject: str = ""  # without the "[PATCH]" (or "[PATCH n/m]") prefix
    dep3: Mapping[str, str] = field(default_factory=dict)
    files: Tuple[FilePatch, ...] = ()

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()

    @property
    def paths(self) -> List[str]:
        return [fp.path for fp in self.files]

    def restricted(self, keep: Callable[[str], bool]) -> "Patch":
        """This patch with only the file diffs whose path ``keep`` accepts (same name and bytes)."""
        return replace(self, files=tuple(fp for fp in self.files if keep(fp.path)))

    def missing_dep3(self) -> List[str]:
        """DEP-3 fields the style guide asks for that this patch lacks."""
        return [key for key in REQUIRED_DEP3 if key not in self.dep3]

    def mail_header(self, key: str) -> str:
        """A header of the mail part (``From``, ``Date``), ``''`` if absent."""
        head = self.data.decode("utf-8", "replace").split("\n\n", 1)[0]
        head = re.sub(r"\n[ \t]+", " ", head)  # unfold (git folds a long From: before the <address>)
        m = re.search(rf"^{key}: (.*)$", head, re.MULTILINE)
        return m.group(1).strip() if m else ""


def parse_patch(name: str, data: bytes) -> Patch:
    """Parse one patch file's headers, DEP-3 fields and diffs."""
    subject = ""
    dep3: Dict[str, str] = {}
    text = data.decode("utf-8", "replace")
    head, _, rest = text.partition("\n\n")
    if re.match(r"^(From |From:|Subject:|Date:)", head):
        unfolded = re.sub(r"\n[ \t]+", " ", head)
        for line in unfolded.splitlines():
            if line.lower().startswith("subject:"):
                raw = line.split(":", 1)[1].strip()
                decoded = str(email.header.make_header(email.header.decode_header(raw)))
                subject = re.sub(r"^\[PATCH[^\]]*\]\s*", "", decoded)
        body = rest
    else:
        body = text
    for line in body.splitlines():
        if line == "---" or line.startswith("diff --git ") or line.startswith("--- "):
            break
        m = _DEP3_RE.match(line)
        if m:
            dep3.setdefault(m.group(1), m.group(2).strip())
    files = tuple(parse_diff(data, where=name))
    if not files:
        raise PatchFormatError(f"{name}: no diff found (corrupt or empty patch file)")
    return Patch(name=name, data=data, subject=subject, dep3=dep3, files=files)


# -- the series ------------------------------------------------------------------------
@dataclass(frozen=True)
class Series:
    """The ordered patches of a series directory, with the base they apply to."""

    directory: Path
    manifest: Manifest
    patches: Tuple[Patch, ...]

    @property
    def base(self) -> Base:
        return self.manifest.base

    @property
    def revision(self) -> int:
        return self.manifest.revision

    @property
    def version(self) -> str:
        """The patched build's version, ``<base>+fsdp.N``."""
        return self.base.patched_version(self.revision)

    @property
    def paths(self) -> List[str]:
        """Every repo-relative path the series touches, in first-touch order."""
        seen: Dict[str, None] = {}
        for patch in self.patches:
            for path in patch.paths:
                seen.setdefault(path, None)
        return list(seen)

    @property
    def file_patches(self) -> List[FilePatch]:
        return [fp for patch in self.patches for fp in patch.files]

    def identity(self) -> dict:
        """What a marker records to say *which* series is applied."""
        return {
            "revision": self.revision,
            "patches": [{"name": p.name, "sha256": p.sha256} for p in self.patches],
        }

    def without(self, names) -> "Series":
        """This series minus the patches named in ``names``."""
        return replace(self, patches=tuple(p for p in self.patches if p.name not in names))

    def upto(self, count: int) -> "Series":
        """The first ``count`` patches: the series as far as PR k of the exported stack.

        Applied, its marker names exactly these patches, so ``revert`` restores
        the base and a later ``apply`` of the whole series upgrades in one step.
        """
        if not 1 <= count <= len(self.patches):
            raise TorchPatchesError(f"--upto {count}: the series has {len(self.patches)} patch(es); "
                                    f"give a number from 1 to {len(self.patches)}", exit_code=2)  # bad usage
        return replace(self, patches=self.patches[:count])

    def restricted(self, keep: Callable[[str], bool]) -> "Series":
        """This series with only the file diffs whose path ``keep`` accepts.

        Patch names and bytes (so :meth:`identity`) are unchanged: an installed
        torch records the whole series as applied, minus what it cannot hold.
        """
        return replace(self, patches=tuple(p.restricted(keep) for p in self.patches))


def read_patches(directory: Path) -> Tuple[Patch, ...]:
    """The patches that ``directory``'s series file lists, parsed, in order."""
    patches = []
    for name in read_series_file(directory).names:
        try:
            data = (directory / name).read_bytes()
        except OSError as exc:
            raise TorchPatchesError(f"series lists {name} but it cannot be read: {exc.strerror}")
        patches.append(parse_patch(name, data))
    return tuple(patches)


def load_series(directory: Optional[os.PathLike] = None) -> Series:
    """Load the series in ``directory`` (default: the newest shipped one)."""
    directory = Path(directory) if directory is not None else default_series_dir()
    manifest = read_manifest(directory)
    return Series(directory=directory, manifest=manifest, patches=read_patches(directory))
