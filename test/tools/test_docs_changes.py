"""docs/what-changes.md is generated from the series (`python -m torch_patches changes`): it
cannot go stale, and every patch in `series` must have a visibility line in changes.ini."""

import shutil

from tooling import REPO, SHIPPED, run_cli
from torch_patches.changes import CHANGES_NAME, COMMAND, DOC, missing_entries, render
from torch_patches.series import load_series


def test_doc_is_the_generated_table():
    """The committed page equals a fresh run of the command (run from another directory)."""
    series = load_series(SHIPPED)
    assert (REPO / DOC).read_text(encoding="utf-8") == render(series), \
        f"{DOC} is stale: the series changed since it was generated; run `{COMMAND}`"
    out = run_cli("changes", "--check", REPO / DOC, check=0, cwd=REPO / "test")
    assert "is up to date" in out.stdout


def test_every_patch_has_a_visibility_line():
    """A patch another helper adds to `series` needs its `[visible]` line (coordinator fills it)."""
    missing = missing_entries(load_series(SHIPPED))
    assert not missing, (f"no [visible] line in {SHIPPED / CHANGES_NAME} for {missing}: add "
                         "`FRAGMENT-OF-THE-FILE-NAME = yes | what a non-user sees` or `= no | why`")


def test_one_row_per_patch_with_files_and_pr():
    series = load_series(SHIPPED)
    rows = [line for line in render(series).splitlines() if line.startswith("| 0")]
    assert [r.split(" | ")[0][2:] for r in rows] == [p.name[:4] for p in series.patches]
    for row, patch in zip(rows, series.patches):
        for path in patch.paths:
            assert path.replace("torch/distributed/", "", 1) in row, (patch.name, row)
        assert "pytorch/pytorch#" in row or "own PR `new-" in row
        assert "| yes: " in row or "| no: " in row


def test_new_patch_without_a_line_fails(tmp_path):
    """The tool refuses (exit 1) a series with a patch it has no visibility line for, naming it;
    --check says how to regenerate a stale page."""
    series = tmp_path / "series"
    shutil.copytree(SHIPPED, series)
    first = load_series(SHIPPED).patches[0].name
    shutil.copy(series / first, series / "0099-FSDP2-Something-brand-new.patch")
    with open(series / "series", "a") as fh:
        fh.write("0099-FSDP2-Something-brand-new.patch\n")
    out = run_cli("changes", "--series", series, cwd=tmp_path)
    assert out.returncode == 1 and "0099-FSDP2-Something-brand-new.patch" in out.stderr, out.stderr
    assert "= yes | why" in out.stderr
    stale = tmp_path / "what-changes.md"
    stale.write_text((REPO / DOC).read_text().replace("| 0001 |", "| 0001x |"))
    out = run_cli("changes", "--check", stale.name, cwd=tmp_path)
    assert out.returncode == 1 and f"regenerate it with `{COMMAND}`" in out.stderr
