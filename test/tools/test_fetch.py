"""The base download: the user's pip configuration, pass-through options, blocks, the cache.

No network: every index here is a local directory. Each test runs pip with a
pip configuration file of its own (``PIP_CONFIG_FILE``, which pip reads after
the machine-wide files, so its keys win) and without inherited ``PIP_*``
variables. ``fetch`` is the code path ``tools/run_tests.sh`` uses.
"""

import os
import shutil

import pytest

from test_wheel import BASE_NAME, base_wheel, expected_version, write_base_wheel  # noqa: F401
from tooling import BASE, run_cli
from torch_patches.wheel.fetch import CONSTRAINT_OVERRIDE, PipOptions, find_cached

PIN = f"torch=={BASE.version}"


@pytest.fixture
def pipenv(tmp_path):
    """``env(conf_text)``: an environment for run_cli with that pip config and an empty cache."""
    cache = tmp_path / "cache"

    def make(conf: str, **extra) -> dict:
        conf_file = tmp_path / "pip.conf"
        conf_file.write_text("[global]\n" + conf)
        env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
        env.update(PIP_CONFIG_FILE=str(conf_file), PIP_DISABLE_PIP_VERSION_CHECK="1",
                   TORCH_PATCHES_CACHE=str(cache), **extra)
        return env
    make.cache = cache
    return make


def _run(*args, env, check=None):
    return run_cli(*args, check=check, env=env, replace_env=True)


@pytest.fixture
def links(base_wheel, tmp_path):  # noqa: F811
    """A find-links directory holding the (small) base wheel, and an empty constraints file."""
    d = tmp_path / "wheels"
    d.mkdir()
    shutil.copy(base_wheel, d / BASE_NAME)
    (tmp_path / "no-caps.txt").write_text("")
    return d


def test_pip_config_find_links_without_index(links, pipenv, one_patch, tmp_path, base_wheel):  # noqa: F811
    """The Done-when case: pip.conf points at a local directory with the base, no network index."""
    env = pipenv(f"no-index = true\nfind-links = {links}\nconstraint = {tmp_path / 'no-caps.txt'}\n")
    proc = _run("wheel", "-o", tmp_path / "dist", "--series", one_patch, env=env, check=0)
    assert "your pip configuration" in proc.stdout and (pipenv.cache / BASE_NAME).is_file()
    assert (tmp_path / "dist" / f"torch-{expected_version(base_wheel)}-py3-none-any.whl").is_file()
    # run_tests.sh's path: fetch prints the cached wheel; pip is not run again
    proc = _run("fetch", "--series", one_patch, env=dict(env, PIP_CONFIG_FILE=os.devnull, PIP_NO_INDEX="1"),
                check=0)
    assert proc.stdout.strip() == str(pipenv.cache / BASE_NAME) and "(cached)" in proc.stderr


def test_index_url_and_find_links_pass_through(links, pipenv, one_patch, tmp_path):
    index = tmp_path / "simple" / "torch"
    index.mkdir(parents=True)
    shutil.copy(links / BASE_NAME, index / BASE_NAME)
    (index / "index.html").write_text(f'<html><body><a href="{BASE_NAME}">{BASE_NAME}</a></body></html>\n')
    caps = f"constraint = {tmp_path / 'no-caps.txt'}\n"
    empty = tmp_path / "empty-simple"
    empty.mkdir()
    env = pipenv(f"index-url = {empty.as_uri()}\n" + caps)
    proc = _run("fetch", "--series", one_patch, "--index-url", (tmp_path / "simple").as_uri(), env=env, check=0)
    from_index = proc.stdout.strip()
    # cached apart from the default base: a build from another index never stands in for it
    assert from_index.startswith(f"{pipenv.cache}/index-") and from_index.endswith("/" + BASE_NAME)
    proc = _run("fetch", "--series", one_patch, "--index-url", (tmp_path / "simple").as_uri(), env=env, check=0)
    assert proc.stdout.strip() == from_index and "(cached)" in proc.stderr
    proc = _run("fetch", "--series", one_patch, env=env)
    assert proc.returncode == 1 and "pip found no" in proc.stderr  # the configured (empty) index
    proc = _run("fetch", "--series", one_patch, "--find-links", links, env=env, check=0)
    assert proc.stdout.strip().endswith("/" + BASE_NAME) and proc.stdout.strip() != from_index


def test_index_without_the_pin(pipenv, one_patch, tmp_path):
    empty = tmp_path / "empty-simple"
    empty.mkdir()
    (tmp_path / "no-caps.txt").write_text("")
    env = pipenv(f"index-url = {empty.as_uri()}\nconstraint = {tmp_path / 'no-caps.txt'}\n")
    proc = _run("wheel", "-o", tmp_path / "dist", "--series", one_patch, env=env)
    assert proc.returncode == 1 and f"pip found no {PIN}" in proc.stderr
    assert empty.as_uri() in proc.stderr  # the index pip looked in
    assert "--index-url URL" in proc.stderr and "--find-links DIR" in proc.stderr and "--base WHEEL" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "dist").exists()


def test_constraint_block_and_override(links, pipenv, one_patch, tmp_path):
    caps = tmp_path / "caps.txt"
    caps.write_text("torch<=2.14.1\n")
    env = pipenv(f"no-index = true\nfind-links = {links}\nconstraint = {caps}\n")
    proc = _run("wheel", "-o", tmp_path / "dist", "--series", one_patch, env=env)
    assert proc.returncode == 1, proc.stderr
    message = proc.stderr.split("error: ", 1)[1]
    assert f"pip's configuration blocks {PIN}: the constraint torch<=2.14.1" in message
    assert str(caps) in message and CONSTRAINT_OVERRIDE in message and "--base WHEEL" in message
    assert f"`{CONSTRAINT_OVERRIDE} python -m torch_patches wheel" in message
    # the documented override, exactly as the message gives it
    proc = _run("wheel", "-o", tmp_path / "dist", "--series", one_patch,
                env=dict(env, PIP_CONSTRAINT=CONSTRAINT_OVERRIDE.split("=", 1)[1]), check=0)
    assert (pipenv.cache / BASE_NAME).is_file()
    # run_tests.sh names itself in the message
    (pipenv.cache / BASE_NAME).unlink()
    proc = _run("fetch", "--series", one_patch, "--as-command", "bash tools/run_tests.sh", env=env)
    assert proc.returncode == 1 and f"`{CONSTRAINT_OVERRIDE} bash tools/run_tests.sh`" in proc.stderr


def test_target_options(pristine_site, pipenv, one_patch, tmp_path):
    """--platform/--python-version go to pip with --only-binary=:all:, and pick the cached wheel."""
    name = f"torch-{BASE.version}-cp312-cp312-manylinux_2_28_x86_64.whl"
    links = tmp_path / "wheels"
    write_base_wheel(pristine_site, links / name)
    (tmp_path / "no-caps.txt").write_text("")
    env = pipenv(f"no-index = true\nfind-links = {links}\nconstraint = {tmp_path / 'no-caps.txt'}\n")
    target = ["--platform", "manylinux_2_28_x86_64", "--python-version", "3.12"]
    proc = _run("fetch", "--series", one_patch, *target, env=env, check=0)
    assert proc.stdout.strip() == str(pipenv.cache / name) and "--only-binary=:all:" in proc.stderr
    proc = _run("fetch", "--series", one_patch, *target, env=env, check=0)
    assert "(cached)" in proc.stderr and proc.stdout.strip() == str(pipenv.cache / name)
    # another target does not take it from the cache
    proc = _run("fetch", "--series", one_patch, "--platform", "win_amd64", "--python-version", "3.12", env=env)
    assert proc.returncode == 1 and "for the target --platform win_amd64" in proc.stderr
    proc = _run("wheel", "--series", one_patch, *target, "-o", tmp_path / "dist", env=env, check=0)
    assert list((tmp_path / "dist").glob("torch-*cp312-cp312-manylinux_2_28_x86_64.whl"))


def test_pip_options_and_cache_lookup(tmp_path):
    opts = PipOptions(index_url="https://example.invalid/simple", find_links=("d",), platforms=("linux_x86_64",),
                      python_version="3.12", abis=("cp312",), implementation="cp")
    assert opts.args() == ["--index-url", "https://example.invalid/simple", "--find-links", "d",
                           "--platform", "linux_x86_64", "--python-version", "3.12", "--abi", "cp312",
                           "--implementation", "cp", "--only-binary=:all:"]
    assert PipOptions(find_links=("d",)).args() == ["--find-links", "d"]  # no target: no --only-binary
    import sys
    for n in (f"torch-{BASE.version}+cpu-py3-none-any.whl", f"torch-{BASE.version}+cpu.fsdp.3-py3-none-any.whl"):
        (tmp_path / n).write_bytes(b"")
    # a +cpu base is a base; a patched +cpu.fsdp.N wheel never is
    assert find_cached(sys.executable, tmp_path, BASE) == tmp_path / f"torch-{BASE.version}+cpu-py3-none-any.whl"


def test_requirements_pin_the_manifest_base():
    from tooling import REPO
    pins = [line.strip() for line in (REPO / "requirements.txt").read_text().splitlines()
            if line.strip() and not line.startswith("#")]
    assert pins == [PIN]
