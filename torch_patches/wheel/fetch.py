"""Obtain the base torch wheel (``torch==<base version>``) for an interpreter or a target, with a cache.

Downloads run ``PY -m pip download --no-deps torch==<base>`` with the user's
own pip configuration (``pip.conf``, ``PIP_*`` variables: index URL, mirror,
certificates, find-links) plus the options given here (:class:`PipOptions`):
the pin on torch is the only requirement added. When the configuration blocks
the pinned release (a constraint file that caps torch, an index that does not
have it), :func:`diagnose` turns pip's output into a message naming the cause
and the override (:data:`CONSTRAINT_OVERRIDE`, ``--index-url``/``--find-links``,
``--base``).

The cache is ``$TORCH_PATCHES_CACHE``, else ``$XDG_CACHE_HOME/torch_patches``
(``~/.cache/torch_patches``); ``wheel``, ``fetch`` and ``tools/run_tests.sh``
share it. A base fetched with explicit index options goes to a subdirectory
of its own (:func:`download_dir`).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List, Optional, Tuple

from ..base import Base
from ..errors import TorchPatchesError

#: pip's own variable replaces the configured constraint files for one command.
CONSTRAINT_OVERRIDE = "PIP_CONSTRAINT=/dev/null"

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
    """Environment for a pip run that must ignore every pip configuration (tests installing
    a wheel file with ``--no-index``). The base download does *not* use it."""
    env = dict(os.environ)
    env["PIP_CONFIG_FILE"] = os.devnull
    env.pop("PIP_CONSTRAINT", None)
    return env


@dataclass(frozen=True)
class PipOptions:
    """``pip download`` options passed through from the command line."""

    index_url: Optional[str] = None
    extra_index_urls: Tuple[str, ...] = ()
    find_links: Tuple[str, ...] = ()
    platforms: Tuple[str, ...] = ()
    python_version: Optional[str] = None
    abis: Tuple[str, ...] = ()
    implementation: Optional[str] = None

    @property
    def has_target(self) -> bool:
        """Whether the wheel is for another target than the interpreter (pip then needs
        ``--only-binary=:all:``)."""
        return bool(self.platforms or self.python_version or self.abis or self.implementation)

    def index_args(self) -> List[str]:
        """The options that choose where pip looks (``--index-url``...)."""
        return self.args()[:self._index_len()]

    def _index_len(self) -> int:
        return 2 * (bool(self.index_url) + len(self.extra_index_urls) + len(self.find_links))

    def args(self) -> List[str]:
        out: List[str] = []
        if self.index_url:
            out += ["--index-url", self.index_url]
        for url in self.extra_index_urls:
            out += ["--extra-index-url", url]
        for link in self.find_links:
            out += ["--find-links", link]
        for platform in self.platforms:
            out += ["--platform", platform]
        if self.python_version:
            out += ["--python-version", self.python_version]
        for abi in self.abis:
            out += ["--abi", abi]
        if self.implementation:
            out += ["--implementation", self.implementation]
        if self.has_target:
            out.append("--only-binary=:all:")
        return out


def interpreter_tags(python: str) -> List[str]:
    try:
        proc = subprocess.run([python, "-c", _TAGS], capture_output=True, text=True)
    except OSError as exc:
        raise TorchPatchesError(f"cannot run {python}: {exc.strerror}")
    if proc.returncode != 0:
        raise TorchPatchesError(f"cannot list the wheel tags of {python}: {proc.stderr.strip()[-300:]}")
    return json.loads(proc.stdout)


def wheel_tags(filename: str) -> set:
    """Expand the compressed tag set of a wheel file name."""
    parts = filename[:-len(".whl")].split("-")
    py, abi, plat = parts[-3], parts[-2], parts[-1]
    return {f"{a}-{b}-{c}" for a in py.split(".") for b in abi.split(".") for c in plat.split(".")}


def target_tags(python: str, options: PipOptions) -> List[str]:
    """The tags a wheel for the target may carry, best first: the interpreter's own, or,
    with a target, the ones matching ``--platform``/``--python-version``/``--abi``/``--implementation``
    (what is not given is the interpreter's)."""
    own = interpreter_tags(python)
    if not options.has_target:
        return own
    first = own[0].split("-")[0] if own else "cp3"  # e.g. cp311
    impl = options.implementation or re.match(r"[a-z]+", first).group(0)  # type: ignore[union-attr]
    version = (options.python_version or first[len(impl):]).replace(".", "")
    interp = f"{impl}{version}"
    abis = list(options.abis) or [interp, "abi3", "none"]
    platforms = list(options.platforms) or list(dict.fromkeys(t.split("-")[2] for t in own)) + ["any"]
    pys = [interp, f"py{version}", f"py{version[:1]}"]
    return [f"{p}-{a}-{pl}" for p in pys for a in abis for pl in platforms]


def base_wheel_candidates(directory: Path, base: Base) -> List[Path]:
    """Base wheels of ``base`` in ``directory``: ``torch-X.Y.Z-...`` and ``torch-X.Y.Z+cpu-...``
    (never a patched ``+...fsdp.N`` one)."""
    found = set(directory.glob(f"torch-{base.version}-*.whl")) | set(directory.glob(f"torch-{base.version}+*-*.whl"))
    return sorted(p for p in found if base.patched_revision(p.name.split("-")[1]) is None)


def find_cached(python: str, directory: Path, base: Base, options: PipOptions = PipOptions()) -> Optional[Path]:
    candidates = base_wheel_candidates(directory, base)
    if not candidates:
        return None
    rank = {t: i for i, t in enumerate(target_tags(python, options))}
    best = None
    for path in candidates:
        scores = [rank[t] for t in wheel_tags(path.name) if t in rank]
        key = (min(scores), "+" in path.name.split("-")[1]) if scores else None  # ties: the unlabelled base
        if key is not None and (best is None or key < best[0]):
            best = (key, path)
    return best[1] if best else None


def download_dir(options: PipOptions) -> Path:
    """Where the base for ``options`` is cached: :func:`cache_dir`, or for explicit index
    options (``--index-url``...) a subdirectory of its own, so that a CPU build fetched from
    another index never stands in for the default base (or the other way round)."""
    index = options.index_args()
    if not index:
        return cache_dir()
    return cache_dir() / ("index-" + hashlib.sha256("\0".join(index).encode()).hexdigest()[:12])


# -- why pip could not get it ----------------------------------------------------------------------
def _configured(python: str, key: str) -> List[str]:
    """``key`` values (``constraint``, ``index-url``...) in ``python``'s pip configuration,
    as ``value (where)``, from ``pip config list`` and the environment."""
    try:
        proc = subprocess.run([python, "-m", "pip", "config", "list"], capture_output=True, text=True, timeout=60)
        lines = proc.stdout.splitlines() if proc.returncode == 0 else []
    except (OSError, subprocess.TimeoutExpired):
        lines = []
    out = []
    for line in lines:
        name, sep, value = line.partition("=")
        if sep and name.rsplit(".", 1)[-1] == key and not name.startswith(":env:"):
            out.append(f"{value.strip(chr(39))} ({name.rsplit('.', 1)[0]} section of pip.conf)")
    env = os.environ.get("PIP_" + key.upper().replace("-", "_"))
    if env:
        out.append(f"{env} (PIP_{key.upper().replace('-', '_')})")
    return out


def diagnose(output: str, python: str, base: Base, options: PipOptions, command: str = "") -> str:
    """The message for a failed base download: the cause named in pip's ``output``, and the override."""
    pin = f"torch=={base.version}"
    again = f": `{CONSTRAINT_OVERRIDE} {command}`" if command else f" with {CONSTRAINT_OVERRIDE}"
    fallback = "or download the wheel yourself and pass it with --base WHEEL"
    caps = re.findall(r"\(constraint\) (torch\S*)", output)
    if caps:
        files = _configured(python, "constraint")
        where = f" from {', '.join(files)}" if files else ""
        return (f"pip's configuration blocks {pin}: the constraint {', '.join(dict.fromkeys(caps))}{where}. "
                f"Lift it for this command{again} (pip's variable replaces the configured constraint "
                f"files), {fallback}")
    if re.search(r"No matching distribution found|Could not find a version that satisfies", output):
        found = re.search(r"\(from versions: ([^)]*)\)", output)
        have = f" (it offers: {found.group(1)})" if found and found.group(1).strip() not in ("", "none") else ""
        looked = [m.strip() for m in re.findall(r"Looking in (?:indexes|links): (.*)", output)]
        where = f" in {'; '.join(looked)}" if looked else " in the configured index"
        target = f" for the target {' '.join(options.args()[:-1])}" if options.has_target else ""
        return (f"pip found no {pin}{target}{where}{have}. Point pip at an index or directory that has it: "
                f"--index-url URL (e.g. https://pypi.org/simple, or https://download.pytorch.org/whl/cpu for "
                f"the CPU build), --find-links DIR, {fallback}")
    tail = "\n  ".join(output.strip().splitlines()[-6:])
    return f"pip could not download {pin}:\n  {tail}\nCheck pip's configuration (`{python} -m pip config list`), {fallback}"


def _run_pip(cmd: List[str]) -> Tuple[int, str]:
    """Run pip, echoing its output to stderr, and return (exit code, output)."""
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    except OSError as exc:
        raise TorchPatchesError(f"cannot run {cmd[0]}: {exc.strerror}")
    lines = []
    assert proc.stdout is not None
    for line in proc.stdout:
        sys.stderr.write(line)
        lines.append(line)
    return proc.wait(), "".join(lines)


def obtain_base_wheel(python: Optional[str], base: Base, progress: Optional[Callable[[str], None]] = None,
                      options: PipOptions = PipOptions(), command: str = "") -> Path:
    """The cached base wheel for ``python`` (or the target in ``options``), downloading it with pip
    if needed. ``command`` is how the message of a blocked download repeats the user's command."""
    python = python or sys.executable
    directory = download_dir(options)
    directory.mkdir(parents=True, exist_ok=True)
    cached = find_cached(python, directory, base, options)
    if cached:
        if progress:
            progress(f"base wheel (cached): {cached}")
        return cached
    if progress:
        progress(f"downloading torch=={base.version} for {python} with pip (your pip configuration"
                 f"{', ' + ' '.join(options.args()) if options.args() else ''}) into {directory} ...")
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        cmd = [python, "-m", "pip", "download", "--no-deps", *options.args(), "-d", tmp, f"torch=={base.version}"]
        code, output = _run_pip(cmd)
        wheels = [p for p in Path(tmp).glob("torch-*.whl")]
        if code != 0 or len(wheels) != 1:
            raise TorchPatchesError(diagnose(output, python, base, options, command) if code != 0 else
                                    f"pip downloaded {len(wheels)} torch wheels, expected one; pass --base WHEEL")
        final = directory / wheels[0].name
        shutil.move(str(wheels[0]), final)
    if progress:
        progress(f"base wheel: {final}")
    return final

