"""Hunks for files an installed torch or a wheel does not hold (``docs/``).

Upstream documents ``fully_shard`` in ``docs/source/distributed.fsdp.fully_shard.md``;
a patch may carry a hunk for it. ``apply --python`` and ``wheel`` skip such
hunks (and say so); a source checkout gets them; ``export`` takes the file's
base content from ``--source`` and includes the hunk.
"""

import zipfile

import pytest

from test_wheel import base_wheel, members  # noqa: F401  (the small base wheel fixture)
from tooling import API, BASE, DI, edit, run_cli, tree_digest, unified, write_patch, write_series

DOC = "docs/source/distributed.fsdp.fully_shard.md"
DOC_TEXT = b"# torch.distributed.fsdp.fully_shard\n\n```{eval-rst}\n.. autofunction:: fully_shard\n```\n"


@pytest.fixture
def docs_series(pristine_site, tmp_path):
    """One patch: a code change in _fsdp_api.py and an entry in the fully_shard docs."""
    d = tmp_path / "docs-series"
    api = (pristine_site / API).read_bytes()
    d.mkdir()
    write_patch(d, "0001-policy-docs.patch", "Add policy with docs",
                unified(API, api, edit(api, "patched-by-0001"))
                + unified(DOC, DOC_TEXT, DOC_TEXT + b"\n```{eval-rst}\n.. autoclass:: FSDPPolicy\n```\n"))
    return write_series(d, ["0001-policy-docs.patch"])


@pytest.fixture
def source_with_docs(source_tree):
    (source_tree / DOC).parent.mkdir(parents=True)
    (source_tree / DOC).write_bytes(DOC_TEXT)
    return source_tree


def test_installed_apply_skips_docs_and_status_says_so(site, fake_python, docs_series):
    before = tree_digest(site)
    out = run_cli("apply", "--python", fake_python, "--series", docs_series, check=0).stdout
    assert "applied series revision" in out and f"skipped {DOC}: not part of an installed torch" in out
    assert b"patched-by-0001" in (site / API).read_bytes() and not (site / "docs").exists()
    status = run_cli("status", "--python", fake_python, "--series", docs_series, check=0).stdout
    assert "state:       applied" in status and f"note:        {DOC} is not part of an installed torch" in status
    assert "already applied" in run_cli("apply", "--python", fake_python, "--series", docs_series, check=0).stdout
    run_cli("revert", "--python", fake_python, "--series", docs_series, check=0)
    assert tree_digest(site) == before


def test_wheel_skips_docs(base_wheel, docs_series, tmp_path):  # noqa: F811
    out = run_cli("wheel", "--base", base_wheel, "-o", tmp_path / "dist", "--series", docs_series,
                  "--verify", check=0).stdout
    assert f"skip:   {DOC}" in out and "verify: ok" in out
    wheel = next((tmp_path / "dist").glob("*.whl"))
    with zipfile.ZipFile(wheel) as zf:
        assert not any(n.startswith("docs/") for n in zf.namelist())
        assert b"patched-by-0001" in zf.read(API)
    assert f"{DI}/METADATA" in members(base_wheel)


def test_source_checkout_gets_docs(source_with_docs, docs_series):
    before = tree_digest(source_with_docs)
    run_cli("apply", "--source", source_with_docs, "--series", docs_series, check=0)
    assert b"autoclass:: FSDPPolicy" in (source_with_docs / DOC).read_bytes()
    status = run_cli("status", "--source", source_with_docs, "--series", docs_series, check=0).stdout
    assert "state:       applied" in status and "note:" not in status
    run_cli("revert", "--source", source_with_docs, "--series", docs_series, check=0)
    assert tree_digest(source_with_docs) == before


def test_export_includes_docs_from_source(fake_python, source_with_docs, docs_series, tmp_path):
    out = tmp_path / "upstream"
    repo = tmp_path / "repo"
    repo.mkdir()
    proc = run_cli("export", "--python", fake_python, "--series", docs_series, "-o", out, "--repo", repo)
    assert proc.returncode == 1 and f"changes {DOC}, which an installed torch does not hold" in proc.stderr
    assert "--source DIR" in proc.stderr
    run_cli("export", "--python", fake_python, "--series", docs_series, "-o", out, "--repo", repo,
            "--source", source_with_docs, check=0)
    patch = next((out / "203177").glob("0001-*.patch")).read_text()
    assert f"diff --git a/{DOC} b/{DOC}" in patch and "autoclass:: FSDPPolicy" in patch
    assert BASE.version in (out / "203177" / "PR.md").read_text()
