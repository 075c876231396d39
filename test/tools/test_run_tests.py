"""``tools/run_tests.sh`` and a pip configuration that blocks the pinned torch.

The script uses the user's pip configuration and the base wheel cache; when a
constraint caps torch it stops with the cause and the override
(``PIP_CONSTRAINT=/dev/null``), whether it had to download the base (``fetch``)
or found it in the cache (its own ``pip install``). Offline: a venv without
torch, a find-links directory with a small base wheel, no index.
"""

import os
import shutil
import subprocess
import sys

from test_wheel import BASE_NAME, write_base_wheel
from tooling import BASE, REPO

OVERRIDE = "`PIP_CONSTRAINT=/dev/null bash tools/run_tests.sh`"


def test_run_tests_stops_on_a_constraint_and_reuses_the_cache(pristine_site, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True)
    links = tmp_path / "wheels"
    write_base_wheel(pristine_site, links / BASE_NAME, requires=False)
    caps = tmp_path / "caps.txt"
    caps.write_text("torch<=2.14.1\n")
    conf = tmp_path / "pip.conf"
    conf.write_text(f"[global]\nno-index = true\nfind-links = {links}\nconstraint = {caps}\n")
    cache = tmp_path / "cache"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "VIRTUAL_ENV", "PYTHONPATH"))}
    env.update(PIP_CONFIG_FILE=str(conf), TORCH_PATCHES_CACHE=str(cache), VENV=str(venv))

    def run(**extra):
        return subprocess.run(["bash", str(REPO / "tools/run_tests.sh"), "test/tools/test_layout.py"],
                              env=dict(env, **extra), capture_output=True, text=True, timeout=600)

    # not cached: `fetch` downloads and names the block
    proc = run()
    assert proc.returncode == 1 and "torch<=2.14.1" in proc.stderr and str(caps) in proc.stderr
    assert OVERRIDE in proc.stderr and not list(cache.glob("*.whl"))
    # cached (as `wheel` leaves it): no download, and pip install's block is named the same way
    shutil.copy(links / BASE_NAME, cache / BASE_NAME)
    proc = run()
    assert proc.returncode == 1 and "(cached)" in proc.stderr
    assert f"run_tests.sh: error: pip's configuration blocks torch=={BASE.version}: the constraint torch<=2.14.1" \
        in proc.stderr and OVERRIDE in proc.stderr
    # the override: torch is installed from the cache (the test requirements then need an index)
    proc = run(PIP_CONSTRAINT="/dev/null")
    assert "installing test requirements" in proc.stdout, proc.stdout + proc.stderr
    version = subprocess.run([str(venv / "bin/python"), "-c", "import importlib.metadata as m; "
                              "print(m.version('torch'))"], capture_output=True, text=True).stdout.strip()
    assert version == BASE.version
