"""Docs entries beside the patches (``docs/<tracker key>.md``) and how export uses them.

The series does not carry a hunk for upstream's ``fully_shard`` docs (its exact
v2.15.0 content is not pinned); instead ``export --source DIR`` inserts each
tracker's entries into DIR's ``[docs] file`` and commits them in the tracker's
PR, and without ``--source`` writes them to the PR directory's ``DOCS.md``.
``apply --python`` and ``wheel`` never read them.
"""

import ast
import glob
import textwrap
import zipfile

import pytest

from test_export import _base_files, _git, stack  # noqa: F401  (the two-tracker series fixture)
from test_wheel import base_wheel  # noqa: F401  (the small base wheel fixture)
from tooling import API, REPO, SHIPPED, STATE, load, run_cli, tree_digest
from torch_patches.errors import TorchPatchesError
from torch_patches.series import parse_docs_entries, read_docs_entries, read_manifest
from torch_patches.state import apply_series
from torch_patches.upstream import docs
from torch_patches.upstream import export as ex

DOC = "docs/source/distributed.fsdp.fully_shard.md"
#: The shape of upstream's API section (a small stand-in, not upstream's text).
DOC_TEXT = textwrap.dedent("""\
    # torch.distributed.fsdp.fully_shard

    ```{eval-rst}
    .. currentmodule:: torch.distributed.fsdp
    ```

    The frontend API is `fully_shard` that can be called on a `module`:

    ```{eval-rst}
    .. autofunction:: fully_shard
    ```

    ```{eval-rst}
    .. autoclass:: FSDPModule
        :members:
        :member-order: bysource
    ```

    ```{eval-rst}
    .. autoclass:: UnshardHandle
        :members:
    ```

    ```{eval-rst}
    .. autoclass:: MixedPrecisionPolicy
        :members:
    ```

    ```{eval-rst}
    .. autoclass:: OffloadPolicy
        :members:
    ```
    """)
ENTRY_203177 = textwrap.dedent("""\
    after: .. autoclass:: FSDPModule

    Policy prose.

    after: .. autoclass:: MixedPrecisionPolicy
    ```{eval-rst}
    .. autoclass:: FSDPPolicy
        :members:
    ```
    """)
ENTRY_203176 = "before: .. autoclass:: UnshardHandle\n\nPartial backward prose.\n"
#: DOC_TEXT with both entries, in stack order (#203177, then #203176).
EXPECTED = DOC_TEXT.replace(
    "    :member-order: bysource\n```\n\n",
    "    :member-order: bysource\n```\n\nPolicy prose.\n\nPartial backward prose.\n\n").replace(
    ".. autoclass:: MixedPrecisionPolicy\n    :members:\n```\n",
    ".. autoclass:: MixedPrecisionPolicy\n    :members:\n```\n\n"
    "```{eval-rst}\n.. autoclass:: FSDPPolicy\n    :members:\n```\n")


def _entries(text, name="x.md"):
    return parse_docs_entries(text, name)


# -- the format and the insertion -------------------------------------------------
def test_entry_format():
    first, second = _entries(ENTRY_203177)
    assert (first.where, first.anchor, first.snippet) == ("after", ".. autoclass:: FSDPModule", "Policy prose.\n")
    assert second.where == "after" and second.snippet.startswith("```{eval-rst}\n.. autoclass:: FSDPPolicy")
    with pytest.raises(TorchPatchesError, match=r"x.md:1: expected `after: LINE` or `before: LINE`"):
        _entries("Some text\nafter: .. autoclass:: FSDPModule\nx\n")
    with pytest.raises(TorchPatchesError, match=r"x.md:1: `after: .. autoclass:: FSDPModule` has no snippet"):
        _entries("after: .. autoclass:: FSDPModule\n\n")
    with pytest.raises(TorchPatchesError, match="no `after: LINE`"):
        _entries("\n")


def test_insert_after_and_before_blocks():
    text = docs.insert_all(DOC_TEXT, _entries(ENTRY_203177) + _entries(ENTRY_203176), DOC)
    assert text == EXPECTED
    # a paragraph anchor (outside a fence): its block runs to the next blank line
    para = "Intro line one\nline two\n\nNext\n"
    assert docs.insert(para, _entries("after: line two\nX\n")[0], DOC) == "Intro line one\nline two\n\nX\n\nNext\n"
    assert docs.insert(para, _entries("before: line two\nX\n")[0], DOC) == "X\n\nIntro line one\nline two\n\nNext\n"
    # at the end of the file, without a final newline
    assert docs.insert("a\n\nb", _entries("after: b\nX\n")[0], DOC) == "a\n\nb\n\nX\n"


def test_missing_or_ambiguous_anchor_is_an_error_naming_file_and_anchor():
    entry = _entries("after: .. autoclass:: FSDPModuleX\nX\n", "docs/203177.md")[0]
    with pytest.raises(TorchPatchesError) as info:
        docs.insert(DOC_TEXT, entry, DOC)
    msg = str(info.value)
    assert msg.startswith(f"docs entry docs/203177.md: anchor `.. autoclass:: FSDPModuleX` (its `after:` line) "
                          f"not found in {DOC}")
    twice = DOC_TEXT + "\n```{eval-rst}\n.. autoclass:: FSDPModule\n```\n"
    with pytest.raises(TorchPatchesError, match=r"occurs 2 times in .* \(lines 14, 35\)"):
        docs.insert(twice, _entries("after: .. autoclass:: FSDPModule\nX\n")[0], DOC)


# -- the shipped entries ------------------------------------------------------------
def test_shipped_entries_fit_upstreams_api_section():
    """Every shipped entry file belongs to a [trackers] key with a patch, and the
    entries insert in stack order into a file shaped like upstream's API section."""
    manifest = read_manifest(SHIPPED)
    entries = read_docs_entries(SHIPPED)
    assert set(entries) == {"203177", "203176", "Add-read-only-FSDPModule-queries"}
    assert manifest.docs_file == DOC
    keys = [t.key for t in manifest.trackers]
    assert set(entries) <= set(keys)
    text = DOC_TEXT
    for key in ("203177", "203176", "Add-read-only-FSDPModule-queries"):  # the stack order
        text = docs.insert_all(text, entries[key], DOC)
    at = {name: text.index(name) for name in (
        ".. autoclass:: FSDPModule", "FSDPModule.get_fsdp_policy", "FSDPModule.partial_backward",
        "FSDPModule.has_pending_gradients", "FSDPModule.unsharded_parameters", ".. autoclass:: UnshardHandle",
        ".. autoclass:: MixedPrecisionPolicy", ".. autoclass:: FSDPPolicy", ".. autoclass:: OffloadPolicy")}
    assert list(at.values()) == sorted(at.values()), at
    for method in ("set_fsdp_policy", "fsdp_policy", "finish_forward"):
        assert f":meth:`FSDPModule.{method}`" in text
    assert text.count("```{eval-rst}") == DOC_TEXT.count("```{eval-rst}") + 4
    assert text.count("```\n") == text.count("```{eval-rst}\n")  # every fence closed


def test_setup_ships_the_docs_entries():
    """``pip install .`` ships what package_data globs (files only, as setuptools does)."""
    tree = ast.parse((REPO / "setup.py").read_text())
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup")
    patterns = ast.literal_eval(next(k.value for k in call.keywords if k.arg == "package_data"))["torch_patches"]
    root = REPO / "torch_patches"
    shipped = {p for pattern in patterns for p in glob.glob(str(root / pattern))}
    wanted = {str(p) for p in (root / "patches").rglob("*") if p.is_file() and "__pycache__" not in p.parts}
    assert wanted - shipped == set()
    assert any(p.endswith("/docs/203177.md") for p in shipped)


# -- export -----------------------------------------------------------------------------
@pytest.fixture
def docs_stack(stack, source_tree):  # noqa: F811
    """The two-tracker series with docs entries for both, and a source tree with the docs file."""
    series, repo = stack
    (series.directory / "docs").mkdir()
    (series.directory / "docs" / "203177.md").write_text(ENTRY_203177)
    (series.directory / "docs" / "203176.md").write_text(ENTRY_203176)
    (source_tree / DOC).parent.mkdir(parents=True)
    (source_tree / DOC).write_text(DOC_TEXT)
    return load(series.directory), repo, source_tree


def _export(fake_python, series, repo, out, *extra, check=0):
    return run_cli("export", "--python", fake_python, "--series", series.directory, "-o", out, "--repo", repo,
                   *extra, check=check)


def test_export_with_source_commits_the_docs(pristine_site, fake_python, docs_stack, tmp_path):
    series, repo, source = docs_stack
    out = tmp_path / "upstream"
    proc = _export(fake_python, series, repo, out, "--source", source)
    assert "export: 5 patch(es) for 2 PR(s)" in proc.stdout
    names = sorted(p.name for p in (out / "203177").glob("*.patch"))
    assert names[-1] == "0003-FSDP2-Add-docs-for-value-based-FSDPPolicy.patch", names
    docs_patch = (out / "203177" / names[-1]).read_text()
    assert f"diff --git a/{DOC} b/{DOC}" in docs_patch and "Bug: https://github.com/pytorch/pytorch/issues/203177" \
        in docs_patch and "after the block of `.. autoclass:: MixedPrecisionPolicy`" in docs_patch
    assert not (out / "203177" / ex.DOCS_NAME).exists()
    pr = (out / "203177" / "PR.md").read_text()
    assert f"### Docs\n\nThe last commit adds entries to `{DOC}`" in pr
    # the source patches and tests are exported as before (no docs in them)
    assert DOC not in next((out / "203177").glob("0001-*.patch")).read_text()

    # git am of the whole stack onto the base with the docs file gives both entries in order
    tree = tmp_path / "am-tree"
    base = {**_base_files(pristine_site), DOC: DOC_TEXT.encode()}
    for rel, data in base.items():
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        (tree / rel).write_bytes(data)
    _git(tree, "init", "-q")
    _git(tree, "add", "-A")
    _git(tree, "commit", "-qm", "base")
    order = [out / line for line in (out / "series").read_text().splitlines() if not line.startswith("#")]
    _git(tree, "am", "-q", "--keep-non-patch", *map(str, order))
    assert (tree / DOC).read_text() == EXPECTED
    expected = apply_series(series, {API: base[API], STATE: base[STATE]})
    assert (tree / API).read_bytes() == expected[API] and (tree / STATE).read_bytes() == expected[STATE]
    assert _git(tree, "log", "--format=%s", "-2").splitlines() == [
        "[FSDP2] Add docs for partial_backward()", "[FSDP2] Add partial"]
    assert (source / DOC).read_text() == DOC_TEXT  # the source checkout is only read


def test_export_missing_anchor_names_file_and_anchor(fake_python, docs_stack, tmp_path):
    series, repo, source = docs_stack
    (series.directory / "docs" / "203176.md").write_text("before: .. autoclass:: NoSuchClass\nX\n")
    proc = _export(fake_python, series, repo, tmp_path / "upstream", "--source", source, check=1)
    assert f"docs/203176.md: anchor `.. autoclass:: NoSuchClass` (its `before:` line) not found in {DOC}" \
        in proc.stderr
    assert "Traceback" not in proc.stderr
    (source / DOC).unlink()
    proc = _export(fake_python, series, repo, tmp_path / "upstream2", "--source", source, check=1)
    assert f"{DOC}: missing in {source}" in proc.stderr


def test_export_without_source_writes_docs_md(fake_python, docs_stack, tmp_path):
    series, repo, _source = docs_stack
    out = tmp_path / "upstream"
    proc = _export(fake_python, series, repo, out)
    assert "export: 3 patch(es) for 2 PR(s)" in proc.stdout  # as before: no docs commits
    assert not any(DOC in p.read_text() for p in out.rglob("*.patch"))
    for key, anchor in (("203177", "after the block of `.. autoclass:: MixedPrecisionPolicy`"),
                        ("203176", "before the block of `.. autoclass:: UnshardHandle`")):
        text = (out / key / ex.DOCS_NAME).read_text()
        assert f"## Into `{DOC}`, {anchor}" in text and "Not committed" in text
        pr = (out / key / "PR.md").read_text()
        assert "**Docs not committed:**" in pr and f"`{ex.DOCS_NAME}` in this directory" in pr
    assert "Policy prose." in (out / "203177" / ex.DOCS_NAME).read_text()


def test_export_warns_about_entries_without_a_tracker(pristine_site, docs_stack, tmp_path):
    series, repo, _source = docs_stack
    (series.directory / "docs" / "203178.md").write_text("after: x\ny\n")
    result = ex.export(load(series.directory), _base_files(pristine_site), tmp_path / "upstream", repo)
    assert any("docs/203178.md: no tracker key '203178' with a patch" in w for w in result.warnings)


# -- apply --python and wheel never read them -------------------------------------------------
@pytest.fixture
def series_with_broken_docs(docs_stack):
    """Entries, one of them unparsable: apply and wheel must not care."""
    series, _repo, _source = docs_stack
    (series.directory / "docs" / "broken.md").write_text("not an entry\n")
    return series.directory


def test_apply_python_ignores_docs_entries(site, fake_python, series_with_broken_docs):
    before = tree_digest(site)
    out = run_cli("apply", "--python", fake_python, "--series", series_with_broken_docs, check=0).stdout
    assert "applied series revision" in out and "skipped" not in out
    assert not any("docs" in rel for rel in tree_digest(site))
    status = run_cli("status", "--python", fake_python, "--series", series_with_broken_docs, check=0).stdout
    assert "state:       applied" in status and "note:" not in status
    run_cli("revert", "--python", fake_python, "--series", series_with_broken_docs, check=0)
    assert tree_digest(site) == before


def test_wheel_ignores_docs_entries(base_wheel, series_with_broken_docs, tmp_path):  # noqa: F811
    out = run_cli("wheel", "--base", base_wheel, "-o", tmp_path / "dist", "--series", series_with_broken_docs,
                  "--verify", check=0).stdout
    assert "verify: ok" in out and "skip:" not in out
    with zipfile.ZipFile(next((tmp_path / "dist").glob("*.whl"))) as zf:
        assert not any("docs/" in n or n.endswith(".md") for n in zf.namelist())
