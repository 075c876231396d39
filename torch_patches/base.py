"""The pinned base a series is written against, as a frozen value.

A :class:`Base` is read from the ``[base]`` section of a series directory's
``manifest.ini`` (see :mod:`torch_patches.series`); nothing in the code names a
torch release. The patched build of series revision ``N`` is
``<base version>+<local label>.N`` (PEP 440 local label), e.g. ``X.Y.Z+fsdp.2``; a
wheel keeps its base's own local label in front (``X.Y.Z+cu132.fsdp.2``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple


@dataclass(frozen=True)
class Base:
    """An upstream torch release, and which of its paths the series reads."""

    #: ``torch/version.py`` public ``__version__``, dist-info ``Version``, ``version.txt``.
    version: str
    #: ``torch.version.git_version`` of the release wheels = the release commit.
    git_version: str
    #: Directories whose ``.py`` files ``devtree`` and ``export`` take from an installed base.
    prefixes: Tuple[str, ...] = ()
    #: Repo path prefixes an installed torch or a wheel holds (``torch/``). Hunks for
    #: other paths (``docs/``) apply to source checkouts only.
    packaged: Tuple[str, ...] = ("torch/",)
    #: PEP 440 local-label prefix of patched builds.
    local_label: str = "fsdp"

    @property
    def short(self) -> str:
        """``X.Y.Z (<12 hex digits>)``: how messages name the base."""
        return f"{self.version} ({self.git_version[:12]})"

    def patched_version(self, revision: int, base_label: str = "") -> str:
        """The PEP 440 version of a patched build: ``X.Y.Z+fsdp.3``, or with the base
        build's own local label ``base_label`` kept in front, ``X.Y.Z+cu132.fsdp.3``."""
        return f"{self.version}+{base_label + '.' if base_label else ''}{self.local_label}.{revision}"

    def patched_revision(self, version: str) -> Optional[int]:
        """``N`` if ``version`` is ``<base>+<label>.N`` or ``<base>+<base label>.<label>.N``,
        else ``None``."""
        parts = local_label(version).split(".")
        if public_version(version) == self.version and len(parts) >= 2 and parts[-2] == self.local_label \
                and parts[-1].isdigit():
            return int(parts[-1])
        return None

    def is_packaged(self, path: str) -> bool:
        """Whether an installed torch or a wheel holds repo path ``path``."""
        return path.startswith(self.packaged)


def public_version(version: str) -> str:
    """Return ``version`` without its local label (``X.Y.Z+cu132`` -> ``X.Y.Z``)."""
    return version.split("+", 1)[0]


def local_label(version: str) -> str:
    """Return the local label of ``version`` (``''`` when it has none)."""
    return version.split("+", 1)[1] if "+" in version else ""
