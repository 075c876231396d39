"""The pinned base this series is written against, and the series revision.

Bump :data:`SERIES_REVISION` whenever the content of ``patches/`` changes in a
release: it becomes ``N`` in the patched wheel's version ``2.15.0+fsdp.N``.
"""

#: Upstream release the series applies to (``torch/version.py`` public part,
#: dist-info ``Version``, and ``version.txt`` in a source tree).
BASE_VERSION = "2.15.0"

#: ``torch.version.git_version`` of the PyPI 2.15.0 wheels, and the commit of a
#: v2.15.0 source checkout.
BASE_GIT_VERSION = "d0f2af8b66b20da4baa50644c0cd3f887a2eae2e"

#: Revision ``N`` of the series (``2.15.0+fsdp.N``).
SERIES_REVISION = 1

#: PEP 440 local-label prefix of patched builds.
LOCAL_LABEL = "fsdp"


def patched_version(revision: int = SERIES_REVISION) -> str:
    """Return the PEP 440 version of a patched build, e.g. ``2.15.0+fsdp.3``."""
    return f"{BASE_VERSION}+{LOCAL_LABEL}.{revision}"


def public_version(version: str) -> str:
    """Return ``version`` without its local label (``2.15.0+cu132`` -> ``2.15.0``)."""
    return version.split("+", 1)[0]


def local_label(version: str) -> str:
    """Return the local label of ``version`` (``''`` when it has none)."""
    return version.split("+", 1)[1] if "+" in version else ""


def patched_revision(version: str):
    """Return ``N`` if ``version`` is ``2.15.0+fsdp.N``, else ``None``."""
    label = local_label(version)
    prefix = LOCAL_LABEL + "."
    if public_version(version) == BASE_VERSION and label.startswith(prefix):
        rest = label[len(prefix):]
        if rest.isdigit():
            return int(rest)
    return None
