"""The FSDP lifecycle patch series for torch 2.15.0, and the tools that apply it.

Entry points: :mod:`torch_patches.cli` (``python -m torch_patches``),
:func:`torch_patches.ops.apply` / :func:`~torch_patches.ops.revert` on a target
from :mod:`torch_patches.installed` or :mod:`torch_patches.source`, and
:func:`torch_patches.wheel.build_wheel`. Importing this package never imports
torch.
"""

from .base import BASE_GIT_VERSION, BASE_VERSION, SERIES_REVISION, patched_version

__version__ = "0.1.0"

__all__ = ["BASE_VERSION", "BASE_GIT_VERSION", "SERIES_REVISION", "patched_version", "__version__"]
