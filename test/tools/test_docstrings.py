"""The series' public docstrings in upstream's shape (issue 29, issue 26 point 6).

Run in the test venv, whose torch has the series applied (tools/run_tests.sh
applies it): every public docstring the series adds is at most 40 lines
(upstream ``FSDPModule`` methods: median 12, max 49), has an ``Args:`` section
where the callable takes arguments, and no argument paragraph longer than 8
lines (``help()`` readers); no public docstring of the patched classes cites
an internal ``[Note: ...]`` (those are comments in the implementation files,
which ``help()`` and the rendered docs cannot show); and no line the patches
add describes the history of the code ("2.15.0", "as before", "revision N"):
source says what the code does, history belongs in the commit messages.
"""

import inspect
import re

import pytest

from torch_patches.series import default_series_dir, read_series_file

# The public callables and classes the series adds (docs/api.md)
NEW_FSDP_METHODS = (
    "get_fsdp_policy",
    "set_fsdp_policy",
    "fsdp_policy",
    "finish_forward",
    "partial_backward",
    "has_pending_gradients",
    "unsharded_parameters",
    "is_fsdp_root",
)
MAX_LINES = 40
MAX_ARG_PARAGRAPH = 8
HISTORY = re.compile(r"2\.1[0-9]\.[0-9]|\bas before\b|\brevision [0-9]|\bused to\b", re.IGNORECASE)


def _doc(obj) -> str:
    return inspect.getdoc(obj) or ""


def _new_docstrings():
    from torch.distributed.fsdp import FSDPModule, FSDPPolicy

    docs = {"FSDPPolicy": _doc(FSDPPolicy)}
    for name in NEW_FSDP_METHODS:
        docs[f"FSDPModule.{name}"] = _doc(getattr(FSDPModule, name))
    return docs


def _arg_paragraphs(doc: str) -> dict:
    """``{argument: number of lines}`` of the ``Args:`` section."""
    lines = doc.splitlines()
    try:
        start = lines.index("Args:") + 1
    except ValueError:
        return {}
    args: dict = {}
    current = None
    for line in lines[start:]:
        if line and not line.startswith(" "):
            break  # the next section
        match = re.match(r"^    (\**\w+)", line)
        if match:
            current = match.group(1)
            args[current] = 1
        elif current is not None and line.strip():
            args[current] += 1
    return args


@pytest.mark.parametrize("name", ["FSDPPolicy", *(f"FSDPModule.{n}" for n in NEW_FSDP_METHODS)])
def test_new_docstring_shape(name):
    doc = _new_docstrings()[name]
    assert doc, f"{name} has no docstring"
    num_lines = len(doc.splitlines())
    assert num_lines <= MAX_LINES, f"{name}: {num_lines} lines (at most {MAX_LINES})"
    assert "[Note" not in doc, f"{name} cites an internal Note"
    for arg, num in _arg_paragraphs(doc).items():
        assert num <= MAX_ARG_PARAGRAPH, f"{name}: argument {arg} takes {num} lines"
    assert doc.count(".. note::") <= 1, f"{name}: more than one note"
    for section in ("Returns:", "Raises:"):
        assert section not in doc, f"{name}: a {section} list (upstream's FSDPModule methods have none)"


def test_args_section_where_there_are_arguments():
    from torch.distributed.fsdp import FSDPModule

    for name in NEW_FSDP_METHODS:
        params = [
            p for p in inspect.signature(getattr(FSDPModule, name)).parameters if p != "self"
        ]
        doc = _doc(getattr(FSDPModule, name))
        if params:
            assert "Args:" in doc, f"FSDPModule.{name}({', '.join(params)}) has no Args: section"
            for param in params:
                assert param in _arg_paragraphs(doc), f"FSDPModule.{name}: {param} not in Args:"


def test_no_public_docstring_cites_an_internal_note():
    from torch.distributed.fsdp import FSDPModule, FSDPPolicy
    from torch.distributed.pipelining import schedules

    owners = [FSDPModule, FSDPPolicy, schedules.PipelineScheduleSingle, schedules.PipelineScheduleMulti]
    citing = []
    for owner in owners:
        for name, member in inspect.getmembers(owner):
            if name.startswith("_") and name != "__init__":
                continue
            if "[Note" in _doc(member) and _doc(member) != _doc(object.__init__):
                citing.append(f"{owner.__name__}.{name}")
    assert not citing, f"public docstrings citing an internal Note: {citing}"


def test_added_lines_describe_the_code_not_its_history():
    directory = default_series_dir()
    found = []
    for name in read_series_file(directory).names:
        text = (directory / name).read_text(encoding="utf-8")
        diff = text[text.index("\ndiff --git ") :]
        for line in diff.splitlines():
            if line.startswith("+") and not line.startswith("+++") and HISTORY.search(line):
                found.append(f"{name}: {line[1:].strip()}")
    assert not found, "added lines that describe history:\n" + "\n".join(found)


def test_the_checks_can_fail():
    """The helpers find what they look for (so the tests above can fail)."""
    doc = "Summary.\n\nArgs:\n    x (int): one\n        two\n\n.. note:: n\n"
    assert _arg_paragraphs(doc) == {"x": 2}
    assert HISTORY.search("kept as 2.15.0 did") and HISTORY.search("runs as before")
    assert not HISTORY.search("the root's group reduces once")
