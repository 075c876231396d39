"""The version-bearing files of a torch install or wheel: dist-info ``METADATA``
and ``torch/version.py``. One reader and one writer for each, used by the
installed target and the wheel builder.
"""

from __future__ import annotations

import ast
import re
from typing import Dict, Iterable, List

from .errors import TorchPatchesError


def metadata_headers(data: bytes) -> Dict[str, str]:
    """The header fields of a METADATA file (``{"name": "torch", "version": ...}``,
    lower-case keys; the first occurrence wins; the body after the blank line is ignored)."""
    headers: Dict[str, str] = {}
    for line in data.decode("utf-8", "replace").splitlines():
        if not line.strip():
            break
        key, sep, value = line.partition(":")
        if sep and not key.startswith((" ", "\t")):
            headers.setdefault(key.strip().lower(), value.strip())
    return headers


def set_metadata_version(data: bytes, version: str) -> bytes:
    """Replace the header ``Version:`` of a METADATA file (body untouched)."""
    head, sep, body = data.partition(b"\n\n")
    new_head, n = re.subn(rb"(?m)^Version:[^\r\n]*", b"Version: " + version.encode(), head, count=1)
    if n != 1:
        raise TorchPatchesError("METADATA has no Version header")
    return new_head + sep + body


def read_version_py(data: bytes) -> Dict[str, object]:
    """Literal assignments of a ``torch/version.py`` (``__version__``, ``git_version``...)."""
    values: Dict[str, object] = {}
    try:
        tree = ast.parse(data)
    except SyntaxError:
        return values
    for node in tree.body:
        target, value = None, None
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            target, value = node.target, node.value
        if isinstance(target, ast.Name) and value is not None:
            try:
                values[target.id] = ast.literal_eval(value)
            except ValueError:
                pass
    return values


def set_version_py(data: bytes, version: str) -> bytes:
    """Replace ``__version__ = '...'`` in ``torch/version.py``."""
    new, n = re.subn(rb"(?m)^__version__(\s*(?::[^=]*)?=\s*)(['\"])[^'\"]*\2",
                     lambda m: b"__version__" + m.group(1) + m.group(2) + version.encode() + m.group(2),
                     data, count=1)
    if n != 1:
        raise TorchPatchesError("torch/version.py has no __version__ assignment")
    return new


def torch_dist_infos(names: Iterable[str]) -> List[str]:
    """The ``torch-*.dist-info`` directories among archive member names."""
    return sorted({n.split("/", 1)[0] for n in names
                   if n.count("/") == 1 and n.endswith(".dist-info/METADATA") and n.startswith("torch-")})
