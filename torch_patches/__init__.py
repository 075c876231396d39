"""The FSDP lifecycle patch series, and the tools that apply it to its pinned torch.

Entry points: :mod:`torch_patches.cli` (``python -m torch_patches``),
:func:`torch_patches.ops.apply` / :func:`~torch_patches.ops.revert` on a
:class:`~torch_patches.series.Series` (``load_series``) and a target from
:mod:`torch_patches.targets.installed` or :mod:`torch_patches.targets.source`,
:func:`torch_patches.wheel.build.build_wheel`, and
:func:`torch_patches.upstream.export.export`. The series directories under
``patches/<base version>/`` carry their own pin (``manifest.ini``). Importing
this package never imports torch.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
