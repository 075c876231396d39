"""What ``apply``/``revert``/``status`` need from a place that holds torch files.

Two implementations: :class:`torch_patches.installed.InstalledTorch` (the torch
of an interpreter) and :class:`torch_patches.source.SourceTree`.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, Iterable, List, Optional

from .base import Base
from .patching import Files


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
        if isinstance(target, ast.Name):
            try:
                values[target.id] = ast.literal_eval(value)
            except ValueError:
                pass
    return values


class Target:
    """A tree of torch files under :attr:`root`, addressed by repo paths."""

    root: Path
    #: ``installed``, ``source`` or ``wheel`` (a torch installed from our wheel).
    kind: str = "?"

    def read(self, rel: str) -> Optional[bytes]:
        try:
            return (self.root / rel).read_bytes()
        except FileNotFoundError:
            return None

    def read_all(self, rels: Iterable[str]) -> Files:
        return {rel: self.read(rel) for rel in rels}

    def mtimes(self, rels: Iterable[str]) -> Dict[str, int]:
        out = {}
        for rel in rels:
            try:
                out[rel] = (self.root / rel).stat().st_mtime_ns
            except FileNotFoundError:
                pass
        return out

    def describe(self) -> List[str]:
        """Lines for ``status``: where, which torch version and commit."""
        raise NotImplementedError

    @property
    def base_version(self) -> str:
        """The public torch version this target holds (picks the shipped series)."""
        raise NotImplementedError

    def base_problem(self, base: Base) -> Optional[str]:
        """Why this is not the pinned ``base`` torch (``None``: it is)."""
        raise NotImplementedError

    def load_marker(self) -> Optional[dict]:
        raise NotImplementedError

    def verify_pristine(self, pristine: Files) -> List[str]:
        """Problems proving ``pristine`` is the base's own content (empty: fine)."""
        return []

    def is_unmodified(self, files: Files) -> bool:
        """Whether ``files`` are provably the target's own, unedited base content.

        Only then may a patch that the files already contain be called retired
        (see [Note: retired patches] in :mod:`torch_patches.state`). Default:
        cannot tell.
        """
        return False

    def commit(self, pristine: Files, new: Optional[Files], marker: Optional[dict]) -> None:
        """Write ``new`` (apply, with ``marker``) or ``pristine`` (revert, ``new is None``)."""
        raise NotImplementedError
