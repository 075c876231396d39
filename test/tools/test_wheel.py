"""The patched wheel: raw-copied members, RECORD, version agreement, pip install."""

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tooling import (API, BASE, DI, NEW_FILE, REVISION, TOUCHED_DIRS, empty_series_dir, python_wrapper,
                     run_cli)
from torch_patches.base import local_label
from torch_patches.distinfo import read_version_py, set_metadata_version, set_version_py
from torch_patches.wheel.fetch import pip_env, wheel_tags
from torch_patches.record import record_hash
from torch_patches.wheel.build import output_name, verify_wheel

BASE_NAME = f"torch-{BASE.version}-py3-none-any.whl"
#: The default base's torch.__version__ label (the PyPI wheel: cu132) stays in front of fsdp.N.
PATCHED_CU = BASE.patched_version(REVISION, "cu132")


def write_base_wheel(pristine_site: Path, path: Path, label=None, requires=True) -> Path:
    """A small base wheel with the real touched files, dist-info and version.py.

    ``label=None``: exactly the installed base's version.py and METADATA (PyPI's
    ``X.Y.Z+cu132`` / ``X.Y.Z``); else both say ``X.Y.Z+label`` (``X.Y.Z`` for ``""``),
    like a CPU build (``cpu``) from download.pytorch.org. ``requires=False`` drops the
    ``Requires-Dist`` lines (to pip install it with its dependencies, offline)."""
    di = DI if not label else f"torch-{BASE.version}+{label}.dist-info"
    version_py = (pristine_site / "torch/version.py").read_bytes()
    metadata = (pristine_site / DI / "METADATA").read_bytes()
    if label is not None:
        full = BASE.version + (f"+{label}" if label else "")
        version_py, metadata = set_version_py(version_py, full), set_metadata_version(metadata, full)
    if not requires:
        metadata = b"".join(line for line in metadata.splitlines(keepends=True)
                            if not line.startswith(b"Requires-Dist:"))
    members = {"torch/__init__.py": b"", "torch/version.py": version_py}
    for rel in TOUCHED_DIRS:
        for p in sorted((pristine_site / rel).rglob("*.py")):
            members[str(p.relative_to(pristine_site))] = p.read_bytes()
    members[f"{di}/METADATA"] = metadata
    members[f"{di}/WHEEL"] = b"Wheel-Version: 1.0\r\nGenerator: test\r\nRoot-Is-Purelib: false\r\nTag: py3-none-any\r\n"
    license_ = b"license text\n"
    rows = {**members, f"{di}/licenses/LICENSE": license_}
    record = "".join(f"{n},{record_hash(d)},{len(d)}\r\n" for n, d in rows.items()) + f"{di}/RECORD,,\r\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr(zipfile.ZipInfo("torch/"), b"")
        zf.writestr(zipfile.ZipInfo(f"{di}/"), b"")
        for name, data in members.items():
            info = zipfile.ZipInfo(name, date_time=(2026, 1, 2, 3, 4, 6))
            info.external_attr = 0o644 << 16
            zf.writestr(info, data, zipfile.ZIP_STORED if name.endswith("__init__.py") else zipfile.ZIP_DEFLATED)
        zf.writestr(f"{di}/RECORD", record)
        zf.writestr(f"{di}/licenses/LICENSE", license_)  # after RECORD, like torch's wheel
    return path


@pytest.fixture(scope="session")
def base_wheel(pristine_site, tmp_path_factory) -> Path:
    """The small base wheel with the installed base's own version.py and METADATA."""
    return write_base_wheel(pristine_site, tmp_path_factory.mktemp("basewheel") / BASE_NAME)


def expected_version(base_wheel: Path, revision=REVISION) -> str:
    """``<base>+<label of the base's torch.__version__>.fsdp.N``."""
    with zipfile.ZipFile(base_wheel) as zf:
        label = local_label(str(read_version_py(zf.read("torch/version.py"))["__version__"]))
    return BASE.patched_version(revision, label)


def members(path):
    with zipfile.ZipFile(path) as zf:
        return {i.filename: zf.read(i.filename) for i in zf.infolist()}


def check_patched_wheel(out: Path, base_wheel: Path, expect_changed: set, revision=REVISION):
    version = expected_version(base_wheel, revision)
    assert out.name == f"torch-{version}-py3-none-any.whl"
    assert verify_wheel(out) == []
    new_di = f"torch-{version}.dist-info"
    old, new = members(base_wheel), members(out)
    di = next(n.split("/")[0] for n in old if n.endswith(".dist-info/METADATA"))
    rename = {n: (new_di + n[len(di):] if n.startswith(di + "/") else n) for n in old}
    added = set(new) - set(rename.values())
    assert added == {f"{new_di}/TORCH_PATCHES.json"} | {p for p in expect_changed if p not in old}
    changed = {n for n in old if rename[n] in new and new[rename[n]] != old[n]}
    assert changed == ({"torch/version.py", f"{di}/METADATA", f"{di}/RECORD"}
                       | {p for p in expect_changed if p in old})
    assert f"__version__ = '{version}'".encode() in new["torch/version.py"]
    old_version = read_version_py(old["torch/version.py"])["__version__"]
    assert new["torch/version.py"].replace(version.encode(), old_version.encode()) == old["torch/version.py"]
    assert f"\nVersion: {version}\n".encode() in new[f"{new_di}/METADATA"]
    with zipfile.ZipFile(out) as zf:  # unchanged members keep their compression and dates
        for info in zf.infolist():
            if info.filename in old and info.filename not in changed:
                orig = zipfile.ZipFile(base_wheel).getinfo(info.filename)
                assert (info.compress_type, info.date_time, info.CRC) == (orig.compress_type, orig.date_time, orig.CRC)
    return new


def test_empty_series_wheel(base_wheel, tmp_path):
    series = empty_series_dir(tmp_path / "empty")
    proc = run_cli("wheel", "--base", base_wheel, "-o", tmp_path / "dist", "--series", series, "--verify", check=0)
    assert "done:" in proc.stdout and " s" in proc.stdout and "verify: ok" in proc.stdout
    check_patched_wheel(tmp_path / "dist" / f"torch-{PATCHED_CU}-py3-none-any.whl", base_wheel, set())


@pytest.mark.parametrize("label, version", [("cpu", f"{BASE.version}+cpu.fsdp.{REVISION}"),
                                            ("", f"{BASE.version}+fsdp.{REVISION}")])
def test_base_local_label_is_kept(pristine_site, one_patch, tmp_path, label, version):
    """A CPU base (``+cpu`` everywhere) gives ``+cpu.fsdp.N``; a base without a label ``+fsdp.N``;
    status recognises a torch installed from either."""
    name = f"torch-{BASE.version}{'+' + label if label else ''}-py3-none-any.whl"
    base = write_base_wheel(pristine_site, tmp_path / "base" / name, label)
    proc = run_cli("wheel", "--base", base, "-o", tmp_path / "dist", "--series", one_patch, check=0)
    out = tmp_path / "dist" / f"torch-{version}-py3-none-any.whl"
    assert f"(torch {version})" in proc.stdout
    check_patched_wheel(out, base, {API, "torch/distributed/fsdp/__init__.py", NEW_FILE})
    target = tmp_path / "target"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--no-compile",
                    "--target", str(target), str(out)], env=pip_env(), check=True, capture_output=True)
    wrapper = python_wrapper(target, tmp_path / "python")
    status = run_cli("status", "--python", wrapper, "--series", one_patch, check=0).stdout
    assert f"patched wheel {version}" in status and "applied      0001-add-policy.patch" in status


def test_one_patch_wheel_and_pip_install(base_wheel, one_patch, tmp_path):
    run_cli("wheel", "--base", base_wheel, "-o", tmp_path / "dist", "--series", one_patch, check=0)
    out = tmp_path / "dist" / f"torch-{PATCHED_CU}-py3-none-any.whl"
    new = check_patched_wheel(out, base_wheel, {API, "torch/distributed/fsdp/__init__.py", NEW_FILE})
    assert b"# patched-by-0001" in new[API]
    target = tmp_path / "target"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                           "--no-compile", "--target", str(target), str(out)],
                          env=pip_env(), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert (target / NEW_FILE).read_bytes() == b"X = 1\n"
    assert (target / f"torch-{PATCHED_CU}.dist-info/TORCH_PATCHES.json").is_file()
    # status recognises a torch installed from the patched wheel
    wrapper = python_wrapper(target, tmp_path / "python")
    status = run_cli("status", "--python", wrapper, "--series", one_patch, check=0).stdout
    assert f"patched wheel {PATCHED_CU}" in status and "applied      0001-add-policy.patch" in status
    assert "already applied" in run_cli("apply", "--python", wrapper, "--series", one_patch, check=0).stdout
    out = run_cli("revert", "--python", wrapper, "--series", one_patch)
    assert out.returncode == 3 and "pip install --force-reinstall" in out.stderr


def test_wheel_without_base_uses_cache(base_wheel, one_patch, tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    shutil.copy(base_wheel, cache / BASE_NAME)
    env = {"TORCH_PATCHES_CACHE": str(cache)}
    proc = run_cli("wheel", "-o", tmp_path / "dist", "--series", one_patch, check=0, env=env)
    assert f"base wheel (cached): {cache / BASE_NAME}" in proc.stdout
    assert verify_wheel(tmp_path / "dist" / f"torch-{PATCHED_CU}-py3-none-any.whl") == []


def test_wheel_refuses_other_base(base_wheel, tmp_path, one_patch):
    bad = tmp_path / BASE_NAME
    with zipfile.ZipFile(base_wheel) as src, zipfile.ZipFile(bad, "w") as dst:
        for info in src.infolist():
            data = src.read(info)
            if info.filename == "torch/version.py":
                data = data.replace(BASE.git_version.encode(), b"f" * 40)
            dst.writestr(info, data)
    out = run_cli("wheel", "--base", bad, "-o", tmp_path / "dist", "--series", one_patch)
    assert out.returncode == 3 and "not the pinned base" in out.stderr
    assert not (tmp_path / "dist").exists() or not list((tmp_path / "dist").iterdir())
    out = run_cli("wheel", "--base", tmp_path / "missing.whl", "--series", one_patch)
    assert out.returncode == 1 and "cannot read base wheel" in out.stderr


def test_names_and_tags():
    assert output_name("torch-1.2.3-cp311-cp311-manylinux_2_28_x86_64.whl", "1.2.3+fsdp.3") == \
        "torch-1.2.3+fsdp.3-cp311-cp311-manylinux_2_28_x86_64.whl"
    assert wheel_tags("x-1-py2.py3-none-any.whl") == {"py2-none-any", "py3-none-any"}
    assert BASE.patched_revision(f"{BASE.version}+fsdp.12") == 12
    assert BASE.patched_revision(f"{BASE.version}+cu132.fsdp.12") == 12
    assert BASE.patched_revision(f"{BASE.version}+cu132") is None
    assert BASE.patched_revision(f"{BASE.version}+cu132.fsdp") is None
    assert BASE.patched_version(3, "cu132") == f"{BASE.version}+cu132.fsdp.3"
    assert BASE.patched_version(3) == f"{BASE.version}+fsdp.3"


def _real_base_wheel():
    from torch_patches.wheel.fetch import cache_dir
    candidates = [os.environ.get("TORCH_PATCHES_REAL_WHEEL", "")]
    candidates += [str(p) for p in sorted(cache_dir().glob(f"torch-{BASE.version}-*.whl"))]
    return next((Path(c) for c in candidates if c and Path(c).is_file()), None)


@pytest.mark.skipif(_real_base_wheel() is None, reason=f"the real torch {BASE.version} wheel is not cached "
                    "(TORCH_PATCHES_REAL_WHEEL or the torch_patches cache)")
def test_real_wheel(tmp_path):
    """Optional: the 540 MB base wheel, with the shipped series."""
    real = _real_base_wheel()
    proc = run_cli("wheel", "--base", real, "-o", tmp_path, check=0)
    out = next(tmp_path.glob(f"torch-{BASE.version}+*fsdp.*.whl"))
    assert verify_wheel(out) == []
    print(proc.stdout)
