"""Build the patched wheel ``torch-<base>+fsdp.N-<tags>.whl`` from the base wheel, and verify one.

The base's own local label stays in front of the series' (PEP 440): a base
whose ``torch.__version__`` is ``X.Y.Z+cu132`` gives ``X.Y.Z+cu132.fsdp.N``, a
CPU base ``X.Y.Z+cpu.fsdp.N``, a base without one ``X.Y.Z+fsdp.N``
(:func:`patched_version`), in the file name, the dist-info directory,
``METADATA`` and ``torch/version.py`` alike.

Only the patched files, ``torch/version.py``, ``METADATA``, ``RECORD`` and the
series marker are written anew; every other member is raw-copied (see
:mod:`torch_patches.wheel.zipraw`), and the dist-info members are renamed in
place. A wheel holds only ``torch/``: hunks for other paths (``docs/``) are
skipped and listed in the progress output.
"""

from __future__ import annotations

import os
import re
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable, Dict, List, Optional

from ..base import local_label, public_version
from ..distinfo import metadata_headers, read_version_py, set_metadata_version, set_version_py, torch_dist_infos
from ..errors import PatchApplyError, TorchPatchesError
from ..marker import MARKER_NAME, Marker
from ..record import Record
from ..series import Series
from ..state import apply_series, base_blob_mismatches
from .fetch import cache_dir
from .zipraw import Entry, RawZipWriter, read_entries, read_member

_WHEEL_RE = re.compile(r"^(?P<name>[^-]+)-(?P<version>[^-]+)(?P<rest>(-\d[^-]*)?-[^-]+-[^-]+-[^-]+\.whl)$")

Progress = Optional[Callable[[str], None]]


def _say(progress: Progress, msg: str) -> None:
    if progress:
        progress(msg)


def output_name(base_name: str, version: str) -> str:
    """``torch-<base>-cp311-...whl`` -> ``torch-<version>-cp311-...whl``."""
    m = _WHEEL_RE.match(base_name)
    if not m:
        raise TorchPatchesError(f"{base_name} is not a wheel file name")
    return f"{m.group('name')}-{version}{m.group('rest')}"


def _dist_info(names: List[str]) -> str:
    found = torch_dist_infos(names)
    if len(found) != 1:
        raise TorchPatchesError(f"the base wheel has {len(found)} torch dist-info directories, expected one")
    return found[0]


@dataclass
class _BaseWheel:
    """The open base wheel: its members in order, and a reader for them."""

    path: Path
    fh: BinaryIO
    entries: List[Entry]

    def __post_init__(self) -> None:
        self.by_name = {e.name: e for e in self.entries}
        self.dist_info = _dist_info(list(self.by_name))
        self.version = metadata_headers(self.read(f"{self.dist_info}/METADATA") or b"").get("version", "")
        self.version_py = read_version_py(self.read("torch/version.py") or b"")

    def read(self, name: str) -> Optional[bytes]:
        entry = self.by_name.get(name)
        return None if entry is None else read_member(self.fh, entry)


def _already_patched(wheel: _BaseWheel, series: Series) -> Optional[str]:
    """What to say when ``wheel`` is itself a patched wheel (it holds the series marker):
    the unpatched base it was built from, and where to get it."""
    raw = wheel.read(f"{wheel.dist_info}/{MARKER_NAME}")
    if raw is None:
        return None
    try:
        marker = Marker.from_bytes(raw, str(wheel.path))
        what, base_name = marker.describe(), marker.base_wheel
    except TorchPatchesError:
        what, base_name = "a series", None
    version = series.base.version
    cached = cache_dir() / base_name if base_name else None
    where = (f"the cached {cached}" if cached is not None and cached.is_file()
             else f"`pip download --no-deps torch=={version}`" + (f" ({base_name})" if base_name else ""))
    return (f"{wheel.path} is already a patched wheel (torch {wheel.version}, {what} applied); --base takes "
            f"the unpatched torch {version} wheel it was built from: {where}, or leave --base out to use the "
            f"cached base (downloaded if missing). Nothing was written")


def _check_base(wheel: _BaseWheel, series: Series) -> None:
    """Refuse (exit 3) a wheel that is not the series' pinned base, or is already patched."""
    patched = _already_patched(wheel, series)
    if patched:
        raise TorchPatchesError(patched, 3)
    version, git_version = wheel.version, wheel.version_py.get("git_version")
    if public_version(version) != series.base.version or git_version != series.base.git_version:
        raise TorchPatchesError(
            f"{wheel.path.name} is torch {version} (commit {str(git_version or '?')[:12]}), not the pinned "
            f"base {series.base.short}; nothing was written", 3)


def patched_version(wheel: "_BaseWheel", series: Series) -> str:
    """``<base>+<base's local label>.fsdp.N``: the label of ``torch.__version__`` (``cu132``),
    else of ``METADATA`` (``cpu``), is kept."""
    label = local_label(str(wheel.version_py.get("__version__", ""))) or local_label(wheel.version)
    return series.base.patched_version(series.revision, label)


def _new_members(wheel: _BaseWheel, series: Series, version: str,
                 progress: Progress) -> Dict[str, Optional[bytes]]:
    """The members written anew: patched files, version.py, METADATA and the marker."""
    held = series.restricted(series.base.is_packaged)
    for path in (p for p in series.paths if not series.base.is_packaged(p)):
        _say(progress, f"skip:   {path} (not part of a wheel; source checkouts and export include it)")
    pristine = {p: wheel.read(p) for p in held.paths}
    problems = base_blob_mismatches(held, pristine)
    if problems:
        raise TorchPatchesError("the base wheel's files are not the ones the series expects:\n  "
                                + "\n  ".join(problems))
    try:
        patched = apply_series(held, pristine)
    except PatchApplyError as exc:
        raise TorchPatchesError(f"{exc}; nothing was written")
    _say(progress, f"series: revision {series.revision}, {len(series.patches)} patch(es), "
                   f"{sum(patched[p] != pristine[p] for p in patched)} file(s) changed")
    new_di = f"torch-{version}.dist-info"
    marker = Marker.build(series, pristine, patched, kind="wheel", keep_pristine=False, base_wheel=wheel.path.name,
                          version=version)
    return {**patched,
            "torch/version.py": set_version_py(wheel.read("torch/version.py") or b"", version),
            f"{new_di}/METADATA": set_metadata_version(wheel.read(f"{wheel.dist_info}/METADATA") or b"",
                                                       version),
            f"{new_di}/{MARKER_NAME}": marker.to_bytes()}


def _write(wheel: _BaseWheel, out_path: Path, new_di: str, content: Dict[str, Optional[bytes]]) -> None:
    """Write the patched wheel next to ``out_path`` and move it into place (all or nothing)."""
    old_di = wheel.dist_info

    def rename(n: str) -> str:
        return new_di + n[len(old_di):] if n.split("/", 1)[0] == old_di else n

    record_name = f"{new_di}/RECORD"
    record = Record((wheel.read(f"{old_di}/RECORD") or b"").decode("utf-8"))
    record_bytes = record.rewritten(rename, content, record_name).encode("utf-8")
    renamed = {rename(e.name) for e in wheel.entries}
    created = sorted(p for p in content if p not in renamed and content[p] is not None)
    tmp_path = out_path.with_name(out_path.name + ".part")
    try:
        with open(tmp_path, "wb") as dst:
            writer = RawZipWriter(wheel.fh, dst)
            for entry in wheel.entries:
                name = rename(entry.name)
                if name == record_name:  # new members go just before RECORD
                    for p in created:
                        writer.add(p, content[p], like=entry)
                    writer.add(name, record_bytes, like=entry)
                elif name in content:
                    if content[name] is not None:
                        writer.add(name, content[name], like=entry)
                elif name != entry.name:
                    writer.rename(entry, name)
                else:
                    writer.copy(entry)
            writer.finish()
        os.replace(tmp_path, out_path)
    except BaseException:
        tmp_path.unlink(missing_ok=True)
        raise


def _what_file(path: Path) -> str:
    """A few words on what ``path`` holds, judged from its first bytes."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(4096)
    except OSError:
        return "a file that cannot be read"
    if not head:
        return "an empty file"
    if head.startswith(b"PK"):
        return "a zip archive that is truncated or damaged"
    return "a text file" if b"\0" not in head else "a binary file that is not a zip archive"


def _unreadable_base(path: Path, why: str, series: Series) -> str:
    """What to do about a base wheel that is not a readable zip: only a file this tool
    downloaded into its cache may be deleted; a user's own file is kept, and the message
    says what ``--base`` expects instead."""
    version = series.base.version
    if cache_dir().resolve() in path.resolve().parents:
        return (f"{path} is not a readable wheel ({why}): the base wheel downloaded into the cache is "
                f"truncated or damaged. Delete that file (the tool downloaded it; `wheel` without --base "
                f"downloads it again), or pass another file with --base WHEEL")
    return (f"{path} is {_what_file(path)}, not a readable wheel ({why}). --base expects the torch {version} wheel file "
            f"(a .whl zip archive, such as the one `pip download --no-deps torch=={version}` writes); "
            f"pass one with --base WHEEL, or leave --base out to use the cached base (downloaded if "
            f"missing). {path} was left as it is")


def build_wheel(base_wheel: os.PathLike, out_dir: os.PathLike, series: Series, progress: Progress = None) -> Path:
    """Write the patched wheel into ``out_dir``; return its path."""
    started = time.monotonic()
    path = Path(base_wheel)
    try:
        fh = open(path, "rb")
    except OSError as exc:
        raise TorchPatchesError(f"cannot read base wheel {path}: {exc.strerror}")
    with fh:
        try:
            wheel = _BaseWheel(path, fh, read_entries(fh)[0])
        except TorchPatchesError as exc:
            raise TorchPatchesError(_unreadable_base(path, str(exc), series))
        _check_base(wheel, series)
        _say(progress, f"base:   {path} ({path.stat().st_size / 1e6:.0f} MB, {len(wheel.entries)} members)")
        version = patched_version(wheel, series)
        content = _new_members(wheel, series, version, progress)
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        out_path = out_dir / output_name(path.name, version)
        _say(progress, f"write:  {out_path} (torch {version})")
        _write(wheel, out_path, f"torch-{version}.dist-info", content)
    _say(progress, f"done:   {out_path.name} ({out_path.stat().st_size / 1e6:.0f} MB) "
                   f"in {time.monotonic() - started:.2f} s")
    return out_path


def verify_wheel(path: os.PathLike) -> List[str]:
    """Check every RECORD hash, coverage, and the version agreement of a wheel.

    Returns the problems found (empty: the wheel is consistent).
    """
    path = Path(path)
    problems = []
    with zipfile.ZipFile(path) as zf:
        names = [n for n in zf.namelist() if not n.endswith("/")]
        di = _dist_info(names)
        record = Record(zf.read(f"{di}/RECORD").decode("utf-8"))
        problems += [f"{n}: in the wheel but not in RECORD" for n in names if n not in record]
        hashed = [row.path for row in record.rows() if row.hash]
        problems += [f"{row.path}: no hash in RECORD" for row in record.rows()
                     if not row.hash and row.path != f"{di}/RECORD"]
        problems += record.verify(hashed, lambda n: zf.read(n) if n in zf.NameToInfo else None)
        name_match = _WHEEL_RE.match(path.name)
        versions = {
            "file name": name_match.group("version") if name_match else "?",
            "dist-info": di[len("torch-"):-len(".dist-info")],
            "METADATA": metadata_headers(zf.read(f"{di}/METADATA")).get("version", ""),
            "torch/version.py": str(read_version_py(zf.read("torch/version.py")).get("__version__")),
        }
        if len(set(versions.values())) != 1:
            problems.append("versions disagree: " + ", ".join(f"{k}={v}" for k, v in versions.items()))
    return problems
