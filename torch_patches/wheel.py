"""Build the patched wheel ``torch-<base>+fsdp.N-<tags>.whl`` from the base wheel.

Only the patched files, ``torch/version.py``, ``METADATA``, ``RECORD`` and the
series marker are written anew; every other member is raw-copied (see
:mod:`torch_patches.zipraw`), and the dist-info members are renamed in place.
"""

from __future__ import annotations

import csv
import io
import os
import re
import time
import zipfile
from pathlib import Path
from typing import Callable, Dict, List, Optional

from . import marker as markers
from .errors import PatchApplyError, TorchPatchesError
from .record import Record, record_hash
from .series import Series
from .state import apply_series, base_blob_mismatches
from .target import read_version_py
from .zipraw import RawZipWriter, read_entries, read_member

_WHEEL_RE = re.compile(r"^(?P<name>[^-]+)-(?P<version>[^-]+)(?P<rest>(-\d[^-]*)?-[^-]+-[^-]+-[^-]+\.whl)$")


def _say(progress: Optional[Callable[[str], None]], msg: str) -> None:
    if progress:
        progress(msg)


def _metadata_version(data: bytes) -> str:
    for line in data.decode("utf-8").splitlines():
        if not line.strip():
            break
        if line.startswith("Version:"):
            return line.split(":", 1)[1].strip()
    return ""


def set_metadata_version(data: bytes, version: str) -> bytes:
    """Replace the header ``Version:`` of a METADATA file (body untouched)."""
    head, sep, body = data.partition(b"\n\n")
    new_head, n = re.subn(rb"(?m)^Version:[^\r\n]*", b"Version: " + version.encode(), head, count=1)
    if n != 1:
        raise TorchPatchesError("base wheel METADATA has no Version header")
    return new_head + sep + body


def set_version_py(data: bytes, version: str) -> bytes:
    """Replace ``__version__ = '...'`` in ``torch/version.py``."""
    new, n = re.subn(rb"(?m)^__version__(\s*(?::[^=]*)?=\s*)(['\"])[^'\"]*\2",
                     lambda m: b"__version__" + m.group(1) + m.group(2) + version.encode() + m.group(2),
                     data, count=1)
    if n != 1:
        raise TorchPatchesError("base wheel torch/version.py has no __version__ assignment")
    return new


def output_name(base_name: str, version: str) -> str:
    """``torch-<base>-cp311-...whl`` -> ``torch-<version>-cp311-...whl``."""
    m = _WHEEL_RE.match(base_name)
    if not m:
        raise TorchPatchesError(f"{base_name} is not a wheel file name")
    return f"{m.group('name')}-{version}{m.group('rest')}"


def _dist_info(names: List[str]) -> str:
    found = sorted({n.split("/", 1)[0] for n in names
                    if n.count("/") == 1 and n.endswith(".dist-info/METADATA") and n.startswith("torch-")})
    if len(found) != 1:
        raise TorchPatchesError(f"the base wheel has {len(found)} torch dist-info directories, expected one")
    return found[0]


def build_wheel(base_wheel: os.PathLike, out_dir: os.PathLike, series: Series,
                progress: Optional[Callable[[str], None]] = None) -> Path:
    """Write the patched wheel into ``out_dir``; return its path."""
    started = time.monotonic()
    base_wheel = Path(base_wheel)
    version = series.version
    try:
        src = open(base_wheel, "rb")
    except OSError as exc:
        raise TorchPatchesError(f"cannot read base wheel {base_wheel}: {exc.strerror}")
    with src:
        entries, _ = read_entries(src)
        by_name = {e.name: e for e in entries}
        names = [e.name for e in entries]

        def read(name: str) -> bytes:
            return read_member(src, by_name[name])

        old_di = _dist_info(names)
        new_di = f"torch-{version}.dist-info"
        meta = read(f"{old_di}/METADATA")
        version_py = read("torch/version.py") if "torch/version.py" in names else b""
        values = read_version_py(version_py)
        base = series.base
        if _metadata_version(meta) != base.version or values.get("git_version") != base.git_version:
            raise TorchPatchesError(
                f"{base_wheel.name} is torch {_metadata_version(meta)} "
                f"(commit {str(values.get('git_version', '?'))[:12]}), not the pinned base "
                f"{base.short}; nothing was written", 3)
        _say(progress, f"base:   {base_wheel} ({base_wheel.stat().st_size / 1e6:.0f} MB, {len(entries)} members)")
        name_set = set(names)
        pristine = {p: (read(p) if p in name_set else None) for p in series.paths}
        problems = base_blob_mismatches(series, pristine)
        if problems:
            raise TorchPatchesError("the base wheel's files are not the ones the series expects:\n  "
                                    + "\n  ".join(problems))
        try:
            patched = apply_series(series, pristine)
        except PatchApplyError as exc:
            raise TorchPatchesError(f"{exc}; nothing was written")
        _say(progress, f"series: revision {series.revision}, {len(series.patches)} patch(es), "
                       f"{sum(patched[p] != pristine[p] for p in patched)} file(s) changed")
        marker = markers.build(series, pristine, patched, kind="wheel", keep_pristine=False)
        marker["base_wheel"] = base_wheel.name
        marker_bytes = markers.dumps(marker)

        new_content: Dict[str, Optional[bytes]] = dict(patched)
        new_content["torch/version.py"] = set_version_py(version_py, version)
        new_content[f"{new_di}/METADATA"] = set_metadata_version(meta, version)
        new_content[f"{new_di}/{markers.MARKER_NAME}"] = marker_bytes

        def rename(n: str) -> str:
            return new_di + n[len(old_di):] if n.split("/", 1)[0] == old_di else n

        record = Record(read(f"{old_di}/RECORD").decode("utf-8"))
        rows = record.rows()
        lines: List[str] = []
        listed = set()
        for path, hash_, size in rows:
            new_path = rename(path)
            listed.add(new_path)
            if new_path == f"{new_di}/RECORD":
                for extra in sorted(p for p in new_content if p not in listed and new_content[p] is not None):
                    lines.append(record.line_for(extra, new_content[extra]))
                    listed.add(extra)
                lines.append(record.line_for(new_path, None))
            elif new_path in new_content:
                if new_content[new_path] is not None:
                    lines.append(record.line_for(new_path, new_content[new_path]))
            else:
                buf = io.StringIO()
                csv.writer(buf, lineterminator=record.newline).writerow([new_path, hash_, size])
                lines.append(buf.getvalue())
        record_bytes = "".join(lines).encode("utf-8")

        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        out_path = out_dir / output_name(base_wheel.name, version)
        tmp_path = out_path.with_name(out_path.name + ".part")
        _say(progress, f"write:  {out_path}")
        try:
            renamed = {rename(n) for n in names}
            created = sorted(p for p in new_content if p not in renamed and new_content[p] is not None)
            with open(tmp_path, "wb") as dst:
                writer = RawZipWriter(src, dst)
                for entry in entries:
                    new_name = rename(entry.name)
                    if new_name == f"{new_di}/RECORD":
                        for p in created:
                            writer.add(p, new_content[p], like=entry)
                        writer.add(new_name, record_bytes, like=entry)
                    elif new_name in new_content:
                        if new_content[new_name] is not None:
                            writer.add(new_name, new_content[new_name], like=entry)
                    elif new_name != entry.name:
                        writer.rename(entry, new_name)
                    else:
                        writer.copy(entry)
                writer.finish()
            os.replace(tmp_path, out_path)
        except BaseException:
            tmp_path.unlink(missing_ok=True)
            raise
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
        rows = record.rows()
        listed = {r[0] for r in rows}
        for n in names:
            if n not in listed:
                problems.append(f"{n}: in the wheel but not in RECORD")
        for r_path, r_hash, r_size in rows:
            if r_path not in zf.NameToInfo:
                problems.append(f"{r_path}: in RECORD but not in the wheel")
            elif r_hash:
                data = zf.read(r_path)
                if record_hash(data) != r_hash or (r_size and int(r_size) != len(data)):
                    problems.append(f"{r_path}: hash/size does not match RECORD")
            elif r_path != f"{di}/RECORD":
                problems.append(f"{r_path}: no hash in RECORD")
        versions = {
            "file name": _WHEEL_RE.match(path.name).group("version") if _WHEEL_RE.match(path.name) else "?",
            "dist-info": di[len("torch-"):-len(".dist-info")],
            "METADATA": _metadata_version(zf.read(f"{di}/METADATA")),
            "torch/version.py": str(read_version_py(zf.read("torch/version.py")).get("__version__")),
        }
        if len(set(versions.values())) != 1:
            problems.append("versions disagree: " + ", ".join(f"{k}={v}" for k, v in versions.items()))
    return problems
