"""The package's shape: no import cycles, no upward imports, one owner per concept."""

import ast
import time
from pathlib import Path

from tooling import REPO, SHIPPED
from torch_patches.marker import Marker
from torch_patches.record import Record, record_hash
from torch_patches.series import NESTED_PATCH_NAME, load_series, read_series_file
from torch_patches.state import State
from torch_patches.upstream.gitstack import slug

PACKAGE = REPO / "torch_patches"
#: Lower layers never import higher ones; a sub-package imports only lower layers and itself.
LAYERS = [
    {"errors", "files", "base"},
    {"patching", "fsutil", "distinfo", "record"},
    {"series"},
    {"state", "marker"},
    {"targets", "wheel", "upstream", "consumers"},
    {"ops", "changes"},
    {"stackcheck"},
    {"cli"},
    {"__main__"},
]


def _module(path: Path) -> str:
    rel = path.relative_to(PACKAGE).with_suffix("")
    return rel.parts[0]


def _imports(path: Path):
    """Top-level ``torch_patches`` modules/sub-packages that ``path`` imports."""
    depth = len(path.relative_to(PACKAGE).parts) - 1  # 0 in the package, 1 in a sub-package
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            parts = (node.module or "").split(".") if node.module else []
            if node.level - 1 == depth:  # relative to the package root
                names = parts[:1] or [a.name for a in node.names]
                out.update(names)
            elif node.level == 1 and depth == 1:  # inside the same sub-package
                out.add(_module(path))
    return out


def test_no_cycles_and_no_upward_imports():
    rank = {name: i for i, layer in enumerate(LAYERS) for name in layer}
    for path in PACKAGE.rglob("*.py"):
        if path.name == "__init__.py" and path.parent == PACKAGE:
            continue
        mod = _module(path)
        assert mod in rank, f"{mod} is not in a layer of test_layout.LAYERS"
        deps = _imports(path) - {mod, "__version__"}
        for dep in deps:  # strictly lower layers only: no cycles, no upward imports
            assert rank[dep] < rank[mod], f"{path.relative_to(REPO)} imports {dep} (same or higher layer)"


def test_series_file_is_parsed_in_one_place():
    offenders = []
    for path in list(PACKAGE.rglob("*.py")) + list((REPO / "tools").rglob("*.py")):
        text = path.read_text()
        if path.name != "series.py" and ('/ "series").read_text' in text or "series_file.read_text" in text):
            offenders.append(str(path.relative_to(REPO)))
    assert offenders == []


def test_record_lookups_are_constant_time():
    rows = "".join(f"torch/lib/f{i},{record_hash(str(i).encode())},{len(str(i))}\r\n" for i in range(13187))
    rec = Record(rows + "torch-x.dist-info/RECORD,,\r\n")
    started = time.perf_counter()
    for i in range(0, 13187, 263):
        assert rec.get(f"torch/lib/f{i}") == (record_hash(str(i).encode()), str(len(str(i))))
    assert time.perf_counter() - started < 0.05  # 50 lookups (csv-parsing each line took 2.3 s)
    assert rec.verify(["torch/lib/f7", "nope"], {"torch/lib/f7": b"7", "nope": b""}.get) == [
        "nope: not listed in RECORD"]


def test_marker_round_trips_and_reads_format_1():
    series = load_series(SHIPPED)
    pristine = {"a.py": b"old\n", "new.py": None}
    marker = Marker.build(series, pristine, {"a.py": b"new\n", "new.py": b"x\n"}, "installed",
                          mtimes={"a.py": 5}, retired={"0009-x.patch": "in base"})
    again = Marker.from_bytes(marker.with_record_undo({"a.py": [3, "a.py,,\n"]}).to_bytes(), "m")
    assert again.same_series(series) and again.pristine_files() == pristine
    assert again.pristine_mtimes() == {"a.py": 5} and again.retired == {"0009-x.patch": "in base"}
    assert again.record_undo == {"a.py": [3, "a.py,,\n"]}
    assert again.changed_since({"a.py": b"new\n", "new.py": b"x\n"}) == []
    assert again.changed_since({"a.py": b"edited\n", "new.py": b"x\n"}) == ["a.py"]


def test_states_are_an_enum():
    assert State("retired") is State.RETIRED and str(State.NOT_APPLIED) == "not applied"


def test_export_series_uses_the_same_parser(tmp_path):
    (tmp_path / "series").write_text("# torch-patches export: ...\n203177/0001-a.patch\nnew-0004/0001-b.patch\n")
    assert read_series_file(tmp_path, NESTED_PATCH_NAME).names == ("203177/0001-a.patch", "new-0004/0001-b.patch")


def test_slugs_end_at_a_word_boundary():
    subject = "[FSDP2] Add partial_backward() and finish_forward() for chunked loss"
    assert slug(subject) == "FSDP2-Add-partial_backward-and-finish_forward-for"
    assert slug("[FSDP2] Add value-based FSDPPolicy with exact restore") == \
        "FSDP2-Add-value-based-FSDPPolicy-with-exact-restore"


def test_readme_map_matches_the_tree():
    """docs/development.md "Where things live" names every module and sub-package, and nothing that is gone."""
    text = (REPO / "docs" / "development.md").read_text()
    block = text.split("## Where things live", 1)[1].split("```", 2)[1]
    stack: list = []
    named = set()
    for line in block.splitlines():
        if not line.strip() or not line.lstrip()[0].isalnum() and not line.lstrip().startswith(("test", "tools")):
            continue
        indent = (len(line) - len(line.lstrip())) // 2
        token = line.split()[0]
        if not (token.endswith("/") or "." in token):
            continue
        stack[indent:] = [token]
        path = "".join(stack) if indent else token
        named.add(path.rstrip("/"))
        if "NNNN" not in path:
            assert (REPO / path).exists(), f"the map names {path}, which does not exist"
    for path in PACKAGE.iterdir():
        if path.name in ("__init__.py", "__main__.py", "__pycache__"):
            continue
        assert any(n == f"torch_patches/{path.name}" or n.startswith(f"torch_patches/{path.name}/") for n in named), \
            f"the map does not mention torch_patches/{path.name}"


def test_setup_packages_every_subpackage():
    """``pip install .`` must ship every sub-package (run_tests.sh runs the installed CLI)."""
    tree = ast.parse((REPO / "setup.py").read_text())
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup")
    packages = ast.literal_eval(next(k.value for k in call.keywords if k.arg == "packages"))
    found = sorted(str(p.parent.relative_to(REPO)).replace("/", ".") for p in PACKAGE.rglob("__init__.py"))
    assert sorted(packages) == found


def test_readme_is_short_and_links_into_docs():
    """README: at most ~150 lines, paste-able commands, imports for what its snippet uses,
    links that resolve (docs/consumers.md is written by the consumer work)."""
    import re
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 150
    for command in ("python -m torch_patches wheel -o dist", "pip install dist/torch-2.15.0+*.whl",
                    "bash tools/run_tests.sh", "bash tools/parity/run.sh"):
        assert f"\n{command}\n" in text, command
    assert "PARITY:" in text and "fsdp.N-*.whl" not in text
    for block in text.split("```python")[1:]:
        code = block.split("```", 1)[0]
        if "F." in code:
            assert "import torch.nn.functional as F" in code
        assert ".chunk(" not in code or all("dim=1" in c for c in re.findall(r"\.chunk\([^)]*\)", code))
    for link in re.findall(r"\]\(((?:docs|tools)/[^)#]+)\)", text):
        assert (REPO / link).exists() or link == "docs/consumers.md", link
    for doc in ("tooling", "api", "upstream", "development", "benchmarks", "changes"):
        assert (REPO / "docs" / f"{doc}.md").is_file() and f"docs/{doc}.md" in text
