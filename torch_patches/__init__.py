"""The FSDP lifecycle patch series, and the tools that apply it to its pinned torch.

Entry points: :mod:`torch_patches.cli` (``python -m torch_patches``),
:func:`torch_patches.ops.apply` / :func:`~torch_patches.ops.revert` on a target
from :mod:`torch_patches.installed` or :mod:`torch_patches.source`, and
:func:`torch_patches.wheel.build_wheel`. Importing this package never imports
torch.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
