"""apply / revert / status on an installed torch (a fake site-packages copy)."""

import json
import os
import re
import stat

import pytest

from tooling import (API, BASE, DI, FSDP_INIT, NEW_FILE, REVISION, STATE, edit, empty_series_dir, run_cli,
                     tree_digest, unified, write_manifest, write_patch, write_series)
from torch_patches import fsutil
from torch_patches.errors import TorchPatchesError
from torch_patches.record import Record, record_hash
from torch_patches.series import default_series_dir, shipped_series_dirs


def record_consistent(site):
    """Every RECORD row of a touched or added file matches the file on disk."""
    rec = Record((site / DI / "RECORD").read_text())
    marker = json.loads((site / DI / "TORCH_PATCHES.json").read_text())
    for path in list(marker["files"]) + [f"{DI}/TORCH_PATCHES.json"]:
        row = rec.get(path)
        data = (site / path).read_bytes() if (site / path).exists() else None
        if data is None:
            assert row is None, path
        else:
            assert row is not None and row[0] == record_hash(data) and int(row[1]) == len(data), path
    return marker


def test_round_trip_one_patch(site, fake_python, one_patch):
    before = tree_digest(site)
    out = run_cli("apply", "--python", fake_python, "--series", one_patch, check=0)
    assert f"applied series revision {REVISION}: 1 patch" in out.stdout
    assert b"# patched-by-0001" in (site / API).read_bytes()
    assert (site / NEW_FILE).read_bytes() == b"X = 1\n"
    marker = record_consistent(site)
    assert [p["name"] for p in marker["series"]["patches"]] == ["0001-add-policy.patch"]
    assert marker["series"]["revision"] == REVISION and marker["kind"] == "installed"

    again = run_cli("apply", "--python", fake_python, "--series", one_patch, check=0)
    assert "already applied" in again.stdout

    status = run_cli("status", "--python", fake_python, "--series", one_patch, check=0).stdout
    assert "pinned base: yes" in status and "d0f2af8b66b20da4baa50644c0cd3f887a2eae2e" in status
    assert "applied      0001-add-policy.patch" in status

    out = run_cli("revert", "--python", fake_python, "--series", one_patch, check=0)
    assert "reverted" in out.stdout
    assert tree_digest(site) == before  # files and RECORD byte for byte, marker gone
    assert "nothing to revert" in run_cli("revert", "--python", fake_python, "--series", one_patch,
                                          check=0).stdout


def test_status_not_applied(site, fake_python, one_patch):
    status = run_cli("status", "--python", fake_python, "--series", one_patch, check=0).stdout
    assert "not applied  0001-add-policy.patch" in status


def test_empty_series(site, fake_python, tmp_path):
    series = empty_series_dir(tmp_path / "empty")
    before = tree_digest(site)
    run_cli("apply", "--python", fake_python, "--series", series, check=0)
    record_consistent(site)
    assert "already applied" in run_cli("apply", "--python", fake_python, "--series", series, check=0).stdout
    assert "empty series" in run_cli("status", "--python", fake_python, "--series", series, check=0).stdout
    run_cli("revert", "--python", fake_python, "--series", series, check=0)
    assert tree_digest(site) == before


def test_newer_series_replaces_older(site, fake_python, one_patch, two_patches):
    before = tree_digest(site)
    run_cli("apply", "--python", fake_python, "--series", one_patch, check=0)
    out = run_cli("apply", "--python", fake_python, "--series", two_patches, check=0)
    assert f"replacing series revision {REVISION}, 1 patch)" in out.stdout  # summarised, no patch names
    assert not (site / NEW_FILE).exists()
    assert b"patched-by-0002" in (site / API).read_bytes()
    assert b"# patched-by-0001" not in (site / FSDP_INIT).read_bytes()
    record_consistent(site)
    run_cli("revert", "--python", fake_python, "--series", two_patches, check=0)
    assert tree_digest(site) == before


def test_wrong_version_refused(site, fake_python, one_patch):
    version_py = site / "torch/version.py"
    version_py.write_text(version_py.read_text().replace("d0f2af8b66b20da4baa50644c0cd3f887a2eae2e", "1" * 40))
    before = tree_digest(site)
    for cmd in ("apply", "revert"):
        out = run_cli(cmd, "--python", fake_python, "--series", one_patch)
        assert out.returncode == 3, out
        assert f"not the pinned base torch {BASE.version}" in out.stderr and "Traceback" not in out.stderr
    assert tree_digest(site) == before
    assert "pinned base: NO" in run_cli("status", "--python", fake_python, "--series", one_patch, check=0).stdout


def test_other_release_refused(site, fake_python, one_patch):
    meta = site / DI / "METADATA"
    meta.write_text(meta.read_text().replace(f"Version: {BASE.version}", "Version: 2.14.1", 1))
    before = tree_digest(site)
    out = run_cli("apply", "--python", fake_python, "--series", one_patch)
    assert out.returncode == 3 and f"install it with `pip install torch=={BASE.version}`" in out.stderr
    out = run_cli("revert", "--python", fake_python, "--series", one_patch)
    assert out.returncode == 3 and "dist 2.14.1" in out.stderr and "nothing of this series to revert" in out.stderr
    assert "pip install" not in out.stderr and "try again" not in out.stderr, out.stderr  # apply's advice
    assert tree_digest(site) == before


def test_corrupt_patch(site, fake_python, one_patch):
    patch = one_patch / "0001-add-policy.patch"
    text = patch.read_text()
    patch.write_text(text[: len(text) // 2])  # truncated in the middle of a hunk
    before = tree_digest(site)
    out = run_cli("apply", "--python", fake_python, "--series", one_patch)
    assert out.returncode == 1 and "0001-add-policy.patch" in out.stderr and "Traceback" not in out.stderr
    assert tree_digest(site) == before


def test_patch_that_does_not_apply(site, fake_python, tmp_path, pristine_site):
    """Second patch conflicts: the first must not be written either (all or nothing)."""
    d = tmp_path / "bad"
    d.mkdir()
    api = (pristine_site / API).read_bytes()
    state = (pristine_site / STATE).read_bytes()
    write_patch(d, "0001-ok.patch", "Ok", unified(API, api, edit(api, "ok")))
    write_patch(d, "0002-bad.patch", "Bad", unified(STATE, b"nothing like it\n" + state, state))
    write_series(d, ["0001-ok.patch", "0002-bad.patch"])
    before = tree_digest(site)
    out = run_cli("apply", "--python", fake_python, "--series", d)
    assert out.returncode == 1 and "0002-bad.patch" in out.stderr and "Nothing was changed" in out.stderr
    assert tree_digest(site) == before


def test_half_applied(site, fake_python, two_patches):
    # Apply only the first patch by hand, as a crashed tool or a manual edit would.
    api = (site / API).read_bytes()
    (site / API).write_bytes(edit(api, "patched-by-0001"))
    before = tree_digest(site)
    out = run_cli("apply", "--python", fake_python, "--series", two_patches)
    assert out.returncode == 1 and "half-applied" in out.stderr and "0001-first.patch applied" in out.stderr
    assert tree_digest(site) == before
    status = run_cli("status", "--python", fake_python, "--series", two_patches, check=0).stdout
    assert "applied      0001-first.patch" in status and "not applied  0002-second.patch" in status
    # revert recovers: the pristine file comes back (checked against RECORD)
    run_cli("revert", "--python", fake_python, "--series", two_patches, check=0)
    assert tree_digest(site)[API] != before[API]
    run_cli("apply", "--python", fake_python, "--series", two_patches, check=0)


def test_modified_after_apply(site, fake_python, one_patch):
    run_cli("apply", "--python", fake_python, "--series", one_patch, check=0)
    with open(site / API, "ab") as fh:
        fh.write(b"# local edit\n")
    before = tree_digest(site)
    for cmd in ("apply", "revert"):
        out = run_cli(cmd, "--python", fake_python, "--series", one_patch)
        assert out.returncode == 1 and "changed after" in out.stderr
    assert tree_digest(site) == before


def test_base_file_not_matching_record(site, fake_python, one_patch):
    with open(site / FSDP_INIT, "ab") as fh:
        fh.write(b"\n")  # the patch still applies, but the file is not the base file
    before = tree_digest(site)
    out = run_cli("apply", "--python", fake_python, "--series", one_patch)
    assert out.returncode == 1 and "not the pristine base files" in out.stderr
    assert tree_digest(site) == before


def test_read_only_target(site, fake_python, one_patch):
    paths = [p for p in site.rglob("*")] + [site]
    for p in paths:
        p.chmod(stat.S_IMODE(p.stat().st_mode) & ~0o222)
    try:
        before = tree_digest(site)
        out = run_cli("apply", "--python", fake_python, "--series", one_patch)
        assert out.returncode == 1 and "not writable" in out.stderr and "Traceback" not in out.stderr
        assert "read-only for this user" in out.stderr and "Run as a user who may write there" in out.stderr
        assert tree_digest(site) == before
        assert not list(site.rglob("*.torch_patches.*"))
    finally:
        for p in paths:
            p.chmod(stat.S_IMODE(p.stat().st_mode) | 0o200)


def test_read_only_file_system(site, one_patch, monkeypatch):
    """On a read-only mount no user can write: the advice is a writable venv or the wheel."""
    real = os.statvfs

    class ReadOnly:
        def __init__(self, path):
            self.f_flag = real(path).f_flag | os.ST_RDONLY

    monkeypatch.setattr(fsutil.os, "statvfs", ReadOnly)
    with pytest.raises(TorchPatchesError) as info:
        fsutil.check_writable(site, [API])
    message = str(info.value)
    assert f"{site / API}: on a read-only file system" in message and "mounted read-only" in message
    assert "Run as a user" not in message and "`python -m venv VENV`" in message
    assert "`torch-patches wheel -o DIR`" in message


def test_no_torch(tmp_path, one_patch):
    wrapper = tmp_path / "python"
    import sys
    empty = tmp_path / "empty"
    empty.mkdir()
    wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" -S "$@"\n')
    wrapper.chmod(0o755)
    out = run_cli("status", "--python", wrapper, "--series", one_patch)
    assert out.returncode == 1 and "has no torch installed" in out.stderr
    out = run_cli("apply", "--python", tmp_path / "missing", "--series", one_patch)
    assert out.returncode == 1 and "no such interpreter" in out.stderr


def test_usage_errors():
    out = run_cli("apply", "--python", "x", "--source", "y")
    assert out.returncode == 2 and "not allowed with" in out.stderr
    out = run_cli("check")
    assert out.returncode == 2 and "--source" in out.stderr


def test_same_revision_other_patches_is_named(site, pristine_site, fake_python, one_patch, tmp_path):
    # Two builds labelled with the same revision but different patches: status says so
    # instead of reporting the recorded series as this one.
    other = tmp_path / "other"
    other.mkdir()
    api = (pristine_site / API).read_bytes()
    write_patch(other, "0001-add-policy.patch", "Add policy", unified(API, api, edit(api, "other-build")))
    write_series(other, ["0001-add-policy.patch"])
    run_cli("apply", "--python", fake_python, "--series", other, check=0)
    status = run_cli("status", "--python", fake_python, "--series", one_patch, check=0).stdout
    assert f"series revision {REVISION}, 1 patch is applied, with other patches than this " \
           f"series' revision {REVISION}" in status, status
    run_cli("apply", "--python", fake_python, "--series", one_patch, check=0)
    status = run_cli("status", "--python", fake_python, "--series", one_patch, check=0).stdout
    assert "state:       applied" in status, status


def test_newer_revision_upgrades_in_one_step(site, fake_python, one_patch, tmp_path):
    # The same patches released as the next revision (manifest.ini [series] revision).
    old_rev = one_patch
    new_rev = write_manifest(tmp_path / "next", revision=REVISION + 1)
    for p in old_rev.iterdir():
        if p.name != "manifest.ini":
            (new_rev / p.name).write_bytes(p.read_bytes())
    before = tree_digest(site)
    run_cli("apply", "--python", fake_python, "--series", old_rev, check=0)
    status = run_cli("status", "--python", fake_python, "--series", new_rev, check=0).stdout
    assert f"series revision {REVISION}, 1 patch is applied; a newer series exists " \
           f"(revision {REVISION + 1}): `apply` upgrades to it in one step" in status, status
    out = run_cli("apply", "--python", fake_python, "--series", new_rev, check=0).stdout
    assert f"applied series revision {REVISION + 1}: 1 patch (replacing series revision {REVISION}" in out
    status = run_cli("status", "--python", fake_python, "--series", new_rev, check=0).stdout
    assert "state:       applied" in status and f"recorded:    series revision {REVISION + 1}" in status
    status = run_cli("status", "--python", fake_python, "--series", old_rev, check=0).stdout
    assert f"newer than this series (revision {REVISION})" in status
    record_consistent(site)
    run_cli("revert", "--python", fake_python, "--series", new_rev, check=0)
    assert tree_digest(site) == before


def _rebase_site(site, version, git_version):
    """Make the fake installed torch claim another release (version.py and METADATA)."""
    vpy = site / "torch/version.py"
    text = vpy.read_text()
    text = re.sub(r"(?m)^__version__ = .*$", f"__version__ = '{version}'", text, count=1)
    text = re.sub(r"(?m)^git_version = .*$", f"git_version = '{git_version}'", text, count=1)
    vpy.write_text(text)
    meta = site / DI / "METADATA"
    meta.write_text(meta.read_text().replace(f"Version: {BASE.version}", f"Version: {version}", 1))


def test_second_base_with_its_own_manifest(site, fake_python, pristine_site, tmp_path):
    """A series directory for another release carries its own pin; no code names a release."""
    other_version, other_git = "9.1.0", "a" * 40
    _rebase_site(site, other_version, other_git)
    d = write_manifest(tmp_path / other_version, version=other_version, git_version=other_git, revision=4)
    api = (pristine_site / API).read_bytes()
    write_patch(d, "0001-other.patch", "Other base", unified(API, api, edit(api, "for-9.1")))
    write_series(d, ["0001-other.patch"], revision=4)
    write_manifest(d, version=other_version, git_version=other_git, revision=4)
    status = run_cli("status", "--python", fake_python, "--series", d, check=0).stdout
    assert f"pinned base: yes ({other_version}, {other_git[:12]})" in status, status
    out = run_cli("apply", "--python", fake_python, "--series", d, check=0).stdout
    assert "applied series revision 4: 1 patch" in out
    marker = json.loads((site / DI / "TORCH_PATCHES.json").read_text())
    assert marker["version"] == f"{other_version}+fsdp.4" and marker["base"]["version"] == other_version
    # The shipped series (another base) refuses this torch.
    out = run_cli("apply", "--python", fake_python)
    assert out.returncode == 3 and f"not the pinned base torch {BASE.version}" in out.stderr
    run_cli("revert", "--python", fake_python, "--series", d, check=0)


def test_shipped_series_is_picked_by_base_version(tmp_path):
    root = tmp_path / "patches"
    for version in ("2.9.0", "10.0.0", "3.1.0"):
        empty_series_dir(root / version)
        write_manifest(root / version, version=version)
    assert [d.name for d in shipped_series_dirs(root)] == ["2.9.0", "3.1.0", "10.0.0"]
    assert default_series_dir("3.1.0", root=root).name == "3.1.0"
    assert default_series_dir(None, root=root).name == "10.0.0"  # newest base
    assert default_series_dir("4.0.0", root=root).name == "10.0.0"  # then its pin refuses the target
