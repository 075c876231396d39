"""What ``apply``/``revert``/``status`` need from a place that holds torch files.

Two implementations: :class:`~torch_patches.targets.installed.InstalledTorch`
(the torch of an interpreter, or a torch installed from our patched wheel) and
:class:`~torch_patches.targets.source.SourceTree`. The change set a commit
writes (the files, the marker) is worked out here once; a target only adds
its own bookkeeping (the installed RECORD).
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, Iterable, List, Optional

from .. import fsutil
from ..base import Base
from ..files import Files
from ..marker import Marker


class Target:
    """A tree of torch files under :attr:`root`, addressed by repo paths."""

    root: Path
    #: ``installed``, ``source`` or ``wheel`` (a torch installed from our wheel).
    kind: str = "?"
    #: Whether the tree holds only what a wheel packages (``torch/``): ``docs/`` etc.
    #: hunks are skipped for it (see :meth:`torch_patches.base.Base.is_packaged`).
    packaged_only: bool = True

    # -- reading --------------------------------------------------------------------
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

    # -- identity ---------------------------------------------------------------------
    def describe(self) -> List[str]:
        """Lines for ``status``: where, which torch version and commit."""
        raise NotImplementedError

    @property
    def base_version(self) -> str:
        """The public torch version this target holds (picks the shipped series)."""
        raise NotImplementedError

    def base_problem(self, base: Base, action: str = "apply") -> Optional[str]:
        """Why this is not the pinned ``base`` torch (``None``: it is), with the advice
        that fits ``action`` (``apply``, ``revert``; status and the rest: as for apply)."""
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

    # -- the marker --------------------------------------------------------------------
    @property
    def marker_rel(self) -> Optional[str]:
        """Where the marker lives under :attr:`root` (``None``: nowhere to put one)."""
        raise NotImplementedError

    def load_marker(self) -> Optional[Marker]:
        """The recorded marker (read once; :meth:`commit` forgets it)."""
        if "_marker" not in self.__dict__:
            rel = self.marker_rel
            data = self.read(rel) if rel is not None else None
            self._marker = None if data is None else Marker.from_bytes(data, str(self.root / rel))
        return self._marker

    # -- writing ---------------------------------------------------------------------------
    def commit(self, pristine: Files, new: Optional[Files], marker: Optional[Marker]) -> None:
        """Write ``new`` (apply, with ``marker``) or ``pristine`` (revert, ``new is None``), all or nothing."""
        current = self.read_all(set(pristine) | set(new or {}))
        wanted = new if new is not None else pristine
        changes: Files = {p: d for p, d in wanted.items() if current.get(p) != d}
        mtimes = None
        if new is None:
            old = self.load_marker()
            mtimes = old.pristine_mtimes() if old else None
        changes.update(self.bookkeeping(pristine, new, marker))
        fsutil.write_files(self.root, changes, mtimes=mtimes)
        self.__dict__.pop("_marker", None)

    def bookkeeping(self, pristine: Files, new: Optional[Files], marker: Optional[Marker]) -> Files:
        """The marker (and, for an installed torch, RECORD) changes of a commit."""
        rel = self.marker_rel
        assert rel is not None, "a target without a marker location cannot be written"
        if new is not None:
            assert marker is not None, "apply writes a marker"
            return {rel: marker.to_bytes()}
        return {rel: None} if self.read(rel) is not None else {}
