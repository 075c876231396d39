"""Unit tests of the diff parser/applier, series parsing and RECORD editing."""

import pytest

from tooling import MANIFEST, unified, write_patch, write_series
from torch_patches.errors import PatchApplyError, PatchFormatError, TorchPatchesError
from torch_patches.patching import apply_file_patch, apply_patches, parse_diff
from torch_patches.record import Record, record_hash
from torch_patches.series import load_series, parse_patch

OLD = b"".join(b"line %d\n" % i for i in range(1, 21))


def _fp(old, new, path="f.py"):
    return parse_diff(unified(path, old, new).encode())[0]


def test_apply_and_reverse():
    new = OLD.replace(b"line 5\n", b"line five\n").replace(b"line 15\n", b"")
    fp = _fp(OLD, new)
    assert len(fp.hunks) == 2
    assert apply_file_patch(OLD, fp) == new
    assert apply_file_patch(new, fp.reversed()) == OLD


def test_offset_allowed_but_no_fuzz():
    new = OLD.replace(b"line 10\n", b"line ten\n")
    fp = _fp(OLD, new)
    shifted = b"extra\n" * 7 + OLD
    assert apply_file_patch(shifted, fp) == b"extra\n" * 7 + new
    with pytest.raises(PatchApplyError, match="does not apply"):
        apply_file_patch(OLD.replace(b"line 8\n", b"line eight\n"), fp)  # context differs


def test_no_newline_at_eof():
    old, new = b"a\nb", b"a\nc"
    text = b"--- a/f\n+++ b/f\n@@ -1,2 +1,2 @@\n a\n-b\n\\ No newline at end of file\n+c\n\\ No newline at end of file\n"
    fp = parse_diff(text)[0]
    assert apply_file_patch(old, fp) == new
    assert apply_file_patch(new, fp.reversed()) == old


def test_create_and_delete():
    files = {"new.py": None, "gone.py": b"x\ny\n"}
    patches = parse_diff((unified("new.py", None, b"hello\n") + unified("gone.py", b"x\ny\n", None)).encode())
    out = apply_patches(files, patches)
    assert out == {"new.py": b"hello\n", "gone.py": None}
    assert apply_patches(out, patches, reverse=True) == files
    with pytest.raises(PatchApplyError, match="already exists"):
        apply_patches(out, patches)


def test_corrupt_diffs():
    good = unified("f.py", OLD, OLD.replace(b"line 3\n", b"x\n"))
    with pytest.raises(PatchFormatError, match="truncated"):
        parse_diff(good[:-20].rsplit("\n", 3)[0].encode() + b"\n")
    with pytest.raises(PatchFormatError, match="unexpected line"):
        parse_diff(good.replace(" line 1\n", "?line 1\n").encode())
    with pytest.raises(PatchFormatError, match="outside the tree"):
        parse_diff(b"--- a/../x\n+++ b/../x\n@@ -1 +1 @@\n-a\n+b\n")


def test_series_and_dep3(tmp_path):
    write_patch(tmp_path, "0001-a.patch", "Add a", unified("f.py", b"a\n", b"b\n"))
    write_patch(tmp_path, "0002-b.patch", "Add b", unified("g.py", b"a\n", b"b\n"), dep3=False)
    write_series(tmp_path, ["0001-a.patch", "0002-b.patch"])
    series = load_series(tmp_path)
    a, b = series.patches
    assert a.subject == "[FSDP2] Add a"
    assert a.dep3 == {"Bug": "https://github.com/pytorch/pytorch/issues/203177",
                      "Forwarded": "not-needed", "Last-Update": "2026-01-01"}
    assert b.missing_dep3() == ["Bug", "Forwarded", "Last-Update"]
    assert series.paths == ["f.py", "g.py"] and series.version == MANIFEST.base.patched_version(MANIFEST.revision)
    (tmp_path / "series").write_text("0001-a.patch\nnot-a-patch\n")
    with pytest.raises(TorchPatchesError, match="expected a NNNN-slug.patch"):
        load_series(tmp_path)
    (tmp_path / "series").write_text("0003-missing.patch\n")
    with pytest.raises(TorchPatchesError, match="cannot be read"):
        load_series(tmp_path)
    with pytest.raises(PatchFormatError, match="no diff"):
        parse_patch("0004-x.patch", b"Subject: nothing\n\nno diff here\n")


def test_record_update_undo_is_byte_exact():
    text = "a.py,sha256=x,1\r\n\"b,c.py\",sha256=y,2\r\nd.py,sha256=z,3\r\nx.dist-info/RECORD,,\r\n"
    rec = Record(text)
    log = rec.update({"a.py": b"new", "b,c.py": None, "e.py": b"e"})
    assert rec.get("a.py") == (record_hash(b"new"), "3")
    assert rec.get("b,c.py") is None and rec.get("e.py") == (record_hash(b"e"), "1")
    assert rec.text().endswith("e.py," + record_hash(b"e") + ",1\r\n")
    rec.undo(log)
    assert rec.text() == text
