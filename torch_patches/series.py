"""Read the patch series: the ``series`` file and each patch with its headers.

A patch is ``git format-patch`` output: mail headers (``From:``, ``Date:``,
``Subject: [PATCH n/m] [FSDP2] ...``), a commit message carrying the DEP-3
fields (``Bug:``, ``Forwarded:``, ``Last-Update:``), ``---``, and the diffs.
"""

from __future__ import annotations

import email.header
import hashlib
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

from . import base
from .errors import PatchFormatError, TorchPatchesError
from .patching import FilePatch, parse_diff

#: Directory of the series shipped with this package.
DEFAULT_SERIES_DIR = Path(__file__).resolve().parent / "patches"

#: DEP-3 fields every patch of this project carries.
REQUIRED_DEP3 = ("Bug", "Forwarded", "Last-Update")

_NAME_RE = re.compile(r"^\d{4}-[A-Za-z0-9._-]+\.patch$")
_DEP3_RE = re.compile(r"^(Description|Origin|Bug(?:-[A-Za-z]+)?|Forwarded|Author|"
                      r"Reviewed-by|Last-Update|Applied-Upstream):\s*(.*)$")


@dataclass
class Patch:
    """One patch file of the series."""

    name: str
    data: bytes
    subject: str = ""  # without the "[PATCH n/m]" prefix
    dep3: Dict[str, str] = field(default_factory=dict)
    files: List[FilePatch] = field(default_factory=list)

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()

    @property
    def paths(self) -> List[str]:
        return [fp.path for fp in self.files]

    def missing_dep3(self) -> List[str]:
        """DEP-3 fields the style guide asks for that this patch lacks."""
        return [key for key in REQUIRED_DEP3 if key not in self.dep3]


@dataclass
class Series:
    """The ordered patches plus the revision ``N`` of ``2.15.0+fsdp.N``."""

    directory: Path
    patches: List[Patch]
    revision: int = base.SERIES_REVISION

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

    @property
    def version(self) -> str:
        return base.patched_version(self.revision)


def parse_patch(name: str, data: bytes) -> Patch:
    """Parse one patch file's headers, DEP-3 fields and diffs."""
    patch = Patch(name=name, data=data)
    text = data.decode("utf-8", "replace")
    head, _, rest = text.partition("\n\n")
    if re.match(r"^(From |From:|Subject:|Date:)", head):
        unfolded = re.sub(r"\n[ \t]+", " ", head)
        for line in unfolded.splitlines():
            if line.lower().startswith("subject:"):
                raw = line.split(":", 1)[1].strip()
                subject = str(email.header.make_header(email.header.decode_header(raw)))
                patch.subject = re.sub(r"^\[PATCH[^\]]*\]\s*", "", subject)
        body = rest
    else:
        body = text
    for line in body.splitlines():
        if line == "---" or line.startswith("diff --git ") or line.startswith("--- "):
            break
        m = _DEP3_RE.match(line)
        if m:
            patch.dep3.setdefault(m.group(1), m.group(2).strip())
    patch.files = parse_diff(data, where=name)
    if not patch.files:
        raise PatchFormatError(f"{name}: no diff found (corrupt or empty patch file)")
    return patch


def read_series_file(directory: Path) -> List[str]:
    """Names listed in ``directory/series`` (comments and blanks skipped)."""
    series_file = directory / "series"
    if not series_file.is_file():
        raise TorchPatchesError(f"no series file at {series_file}")
    names = []
    for lineno, raw in enumerate(series_file.read_text(encoding="utf-8").splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if not _NAME_RE.match(line):
            raise TorchPatchesError(
                f"{series_file}:{lineno}: expected a NNNN-slug.patch name, got {line!r}")
        if line in names:
            raise TorchPatchesError(f"{series_file}:{lineno}: {line} is listed twice")
        names.append(line)
    return names


def load_series(directory: Optional[os.PathLike] = None, revision: Optional[int] = None) -> Series:
    """Load the series in ``directory`` (default: the one shipped here)."""
    directory = Path(directory) if directory is not None else DEFAULT_SERIES_DIR
    patches = []
    for name in read_series_file(directory):
        path = directory / name
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise TorchPatchesError(f"series lists {name} but it cannot be read: {exc.strerror}")
        patches.append(parse_patch(name, data))
    return Series(directory=directory,
                  patches=patches,
                  revision=base.SERIES_REVISION if revision is None else revision)
