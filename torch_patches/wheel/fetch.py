"""Obtain the base torch wheel (``torch==<base version>``) for an interpreter, with a cache.

Downloads go through ``PY -m pip download --no-deps``. Machines that cap
torch with a pip constraint file would refuse the pinned release, so
pip runs with ``PIP_CONFIG_FILE=/dev/null`` and without ``PIP_CONSTRAINT``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable, List, Optional

from ..base import Base
from ..errors import TorchPatchesError

_TAGS = r"""
import json
try:
    from packaging import tags
except ImportError:
    from pip._vendor.packaging import tags
print(json.dumps([str(t) for t in tags.sys_tags()]))
"""


def cache_dir() -> Path:
    """``$TORCH_PATCHES_CACHE`` or ``~/.cache/torch_patches``."""
    env = os.environ.get("TORCH_PATCHES_CACHE")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "torch_patches"


def pip_env() -> dict:
    """Environment for pip that ignores machine-wide config and constraints."""
    env = dict(os.environ)
    env["PIP_CONFIG_FILE"] = os.devnull
    env.pop("PIP_CONSTRAINT", None)
    return env


def interpreter_tags(python: str) -> List[str]:
    proc = subprocess.run([python, "-c", _TAGS], capture_output=True, text=True)
    if proc.returncode != 0:
        raise TorchPatchesError(f"cannot list the wheel tags of {python}: {proc.stderr.strip()[-300:]}")
    return json.loads(proc.stdout)


def wheel_tags(filename: str) -> set:
    """Expand the compressed tag set of a wheel file name."""
    parts = filename[:-len(".whl")].split("-")
    py, abi, plat = parts[-3], parts[-2], parts[-1]
    return {f"{a}-{b}-{c}" for a in py.split(".") for b in abi.split(".") for c in plat.split(".")}


def find_cached(python: str, directory: Path, base: Base) -> Optional[Path]:
    candidates = sorted(directory.glob(f"torch-{base.version}-*.whl"))
    if not candidates:
        return None
    tags = interpreter_tags(python)
    rank = {t: i for i, t in enumerate(tags)}
    best = None
    for path in candidates:
        scores = [rank[t] for t in wheel_tags(path.name) if t in rank]
        if scores and (best is None or min(scores) < best[0]):
            best = (min(scores), path)
    return best[1] if best else None


def obtain_base_wheel(python: Optional[str], base: Base,
                      progress: Optional[Callable[[str], None]] = None) -> Path:
    """The cached base wheel for ``python``, downloading it with pip if needed."""
    python = python or sys.executable
    directory = cache_dir()
    directory.mkdir(parents=True, exist_ok=True)
    cached = find_cached(python, directory, base)
    if cached:
        if progress:
            progress(f"base wheel (cached): {cached}")
        return cached
    if progress:
        progress(f"downloading torch=={base.version} for {python} with pip into {directory} ...")
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        cmd = [python, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "-d", tmp, f"torch=={base.version}"]
        proc = subprocess.run(cmd, env=pip_env(), stdout=sys.stderr)
        wheels = list(Path(tmp).glob("torch-*.whl"))
        if proc.returncode != 0 or len(wheels) != 1:
            raise TorchPatchesError(
                f"pip could not download torch=={base.version} (exit {proc.returncode}); "
                "pass the wheel with --base WHEEL")
        final = directory / wheels[0].name
        shutil.move(str(wheels[0]), final)
    if progress:
        progress(f"base wheel: {final}")
    return final
