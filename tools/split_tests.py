"""Move test methods (with their ``_test_<name>`` helpers) or whole test classes from one
test file into a new one, mechanically: the new file imports what it uses (models,
constants, test bases) from the old one, and each moved class keeps its name, so the
``Class::test`` ids stay the same. Test code is copied as it is.

    python tools/split_tests.py tools/split_tests_issue29.json   # from the repository root

SPEC.json is a list of splits, applied in order:
  {"source": "test/.../test_a.py", "dest": "test/.../test_b.py", "docstring": "...",
   "moves": [{"class": "TestX", "tests": ["test_a", ...] | "*", "new_class": "TestX"}]}
A moved class gets the non-test members it uses (properties, attributes, helpers reached
through ``self.``); helpers no remaining test uses leave the source. Afterwards the
sources' unused imports are removed with ``ruff check --select F401 --fix``. Issue 29
used it to give each exported PR the tests of its own behaviour
(tools/split_tests_issue29.json, with the [trackers] of manifest.ini).
"""

import ast
import json
import re
import sys
from pathlib import Path


def _start(node, lines):
    """First line (0-based) of node incl. decorators and the comments right above it."""
    start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])]) - 1
    while start > 0 and lines[start - 1].strip().startswith("#"):
        start -= 1
    return start


def _span(node, lines):
    return _start(node, lines), node.end_lineno


def split(source: Path, dest: Path, docstring: str, moves):
    text = source.read_text()
    lines = text.splitlines(keepends=True)
    tree = ast.parse(text)
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    remove = []  # (start, end) line spans to cut from source
    new_blocks = []
    moved_classes = []
    fully_moved = []
    for move in moves:
        cls = classes[move["class"]]
        if move["tests"] == "*":
            s, e = _span(cls, lines)
            remove.append((s, e))
            new_blocks.append("".join(lines[s:e]))
            moved_classes.append(cls.name)
            fully_moved.append(cls.name)
            continue
        wanted = set(move["tests"])
        helpers = {"_" + t for t in wanted}
        found = set()
        # the class line(s) up to its first member (decorators and comments included)
        class_start = _start(cls, lines)
        header_end = _start(cls.body[0], lines)
        header = "".join(lines[class_start:header_end])
        header = re.sub(rf"class {cls.name}\b", f"class {move['new_class']}", header, count=1)
        members = []
        methods = {n.name: n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}

        def self_refs(nodes):
            """Names of methods reached through ``self.<name>`` from ``nodes`` (transitively)."""
            seen, todo = set(), list(nodes)
            while todo:
                for n in ast.walk(todo.pop()):
                    if (isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self"
                            and n.attr in methods and n.attr not in seen):
                        seen.add(n.attr)
                        todo.append(methods[n.attr])
            return seen

        is_test = lambda name: (name or "").startswith(("test_", "_test_"))  # noqa: E731
        moved_nodes = [m for name, m in methods.items() if name in wanted or name in helpers]
        kept_nodes = [m for name, m in methods.items() if is_test(name) and name not in wanted and name not in helpers]
        needed_new, needed_old = self_refs(moved_nodes), self_refs(kept_nodes)
        for node in cls.body:
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
                continue  # class docstring stays with the old class
            name = getattr(node, "name", None)
            s, e = _span(node, lines)
            block = "".join(lines[s:e])
            plain_method = name in methods and not is_test(name) and not any(
                isinstance(d, ast.Name) and d.id == "property" for d in node.decorator_list)
            if name in wanted or name in helpers:
                found.add(name)
                remove.append((s, e))
                members.append(block)
            elif plain_method:
                if name in needed_new:
                    members.append(block)  # a helper the moved tests use: copied (or moved)
                if name not in needed_old:
                    remove.append((s, e))
            elif not is_test(name):
                members.append(block)  # properties, attributes: copied
        missing = wanted - found
        assert not missing, (cls.name, missing)
        new_blocks.append(header + "\n".join(members))
        moved_classes.append(move["new_class"])
    # cut from source (bottom up), collapsing the blank lines left behind
    for s, e in sorted(remove, reverse=True):
        del lines[s:e]
    out = "".join(lines)
    out = re.sub(r"\n{4,}", "\n\n\n", out)
    out = re.sub(r"(\n    [^\n]*\n)\n\n+(    (?:def|@|#))", r"\1\n\2", out)
    ast.parse(out)
    # instantiate_parametrized_tests calls for classes that moved entirely
    for name in fully_moved:
        out = re.sub(rf"^instantiate_parametrized_tests\({name}\)\n", "", out, flags=re.MULTILINE)
    source.write_text(out)

    # the new file: the old file's imports (only what the moved code uses), then a sibling import
    body = "\n\n".join(b.rstrip("\n") + "\n" for b in new_blocks)
    used = {n.id for n in ast.walk(ast.parse(body)) if isinstance(n, ast.Name)}
    used |= {n.value.id for n in ast.walk(ast.parse(body)) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)}
    src_tree = ast.parse(text)
    top_names = {}
    imports = []
    helper_import = None
    path_insert = None
    for node in src_tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            if isinstance(node, ast.ImportFrom) and node.module == "fsdp_lifecycle_testing":
                helper_import = node
            elif not (isinstance(node, ast.ImportFrom) and node.module == "__future__"):
                imports.append(node)
        elif isinstance(node, ast.Expr) and "sys.path.insert" in ast.unparse(node):
            path_insert = node
        elif isinstance(node, (ast.ClassDef, ast.FunctionDef)):
            top_names[node.name] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                for n in ast.walk(t):
                    if isinstance(n, ast.Name):
                        top_names[n.id] = node
    moved_defs = {getattr(n, "name", None) for n in ast.parse(body).body}
    # decorators/bases used
    parametrized = "parametrize" in body
    need_run = True
    import_lines = []
    for node in imports:
        names = [a for a in node.names if (a.asname or a.name).split(".")[0] in used
                 or (a.name in ("instantiate_parametrized_tests",) and parametrized)
                 or (a.name == "run_tests" and need_run)]
        if isinstance(node, ast.Import):
            names = [a for a in node.names if (a.asname or a.name).split(".")[0] in used]
        if not names:
            continue
        if isinstance(node, ast.Import):
            for a in names:
                import_lines.append(f"import {a.name}" + (f" as {a.asname}" if a.asname else ""))
        else:
            parts = [a.name + (f" as {a.asname}" if a.asname else "") for a in names]
            one = f"from {node.module} import {', '.join(parts)}"
            if len(one) <= 88:
                import_lines.append(one)
            else:
                import_lines.append(f"from {node.module} import (\n" + "".join(f"    {p},\n" for p in parts) + ")")
    # group: stdlib first (no torch), then torch (keep source order)
    std = [line for line in import_lines if not re.match(r"(from|import) torch", line)]
    tor = [line for line in import_lines if re.match(r"(from|import) torch", line)]
    needs_os_sys = path_insert is not None and helper_import is not None
    helper_names = [a.name for a in helper_import.names if a.name in used] if helper_import else []
    if helper_names:
        for mod in ("os", "sys"):
            if f"import {mod}" not in std:
                std.append(f"import {mod}")
    std.sort(key=lambda s: (s.startswith("from"), s.split()[1]))
    sibling = sorted(n for n in used if n in top_names and n not in moved_defs)
    out = ['# Owner(s): ["oncall: distributed"]\n', f'"""\n{docstring.strip()}\n"""\n\n']
    out.append("\n".join(std) + "\n\n" + "\n".join(tor) + "\n")
    if helper_names and needs_os_sys:
        out.append("\n\n" + "".join(lines_of(text, path_insert)))
        hl = ", ".join(helper_names)
        one = f"from fsdp_lifecycle_testing import {hl}  # noqa: E402"
        out.append((one if len(one) <= 88 else "from fsdp_lifecycle_testing import (  # noqa: E402\n"
                    + "".join(f"    {h},\n" for h in helper_names) + ")") + "\n")
    if sibling:
        mod = source.stem
        noqa = "  # noqa: E402" if helper_names and needs_os_sys else ""
        out.append(("" if noqa else "\n") + f"from {mod} import ({noqa}\n" + "".join(f"    {n},\n" for n in sibling) + ")\n")
    out.append("\n\n" + body.rstrip("\n") + "\n")
    if parametrized:
        out.append("\n\n" + "".join(f"instantiate_parametrized_tests({c})\n" for c in moved_classes))
    out.append('\n\nif __name__ == "__main__":\n    run_tests()\n')
    new = "".join(out)
    ast.parse(new)
    if dest.exists():
        raise SystemExit(f"{dest} exists")
    dest.write_text(new)


def lines_of(text, node):
    lines = text.splitlines(keepends=True)
    return lines[node.lineno - 1:node.end_lineno]


if __name__ == "__main__":
    import subprocess
    specs = json.loads(Path(sys.argv[1]).read_text())
    for spec in specs:
        split(Path(spec["source"]), Path(spec["dest"]), spec["docstring"], spec["moves"])
        print("split", spec["source"], "->", spec["dest"])
    sources = sorted({spec["source"] for spec in specs})
    subprocess.run([sys.executable, "-m", "ruff", "check", "--select", "F401", "--fix", "--no-cache", *sources])
