"""What the CLI says when something is off: each message names the cause and the next step."""

from test_wheel import base_wheel  # noqa: F401  (the small base wheel fixture)
from tooling import API, BASE, REVISION, STATE, edit, python_wrapper, run_cli, tree_digest


def test_status_names_files_edited_after_apply(site, fake_python, two_patches):
    run_cli("apply", "--python", fake_python, "--series", two_patches, check=0)
    (site / STATE).write_bytes(edit((site / STATE).read_bytes(), "by hand"))
    before = tree_digest(site)
    status = run_cli("status", "--python", fake_python, "--series", two_patches, check=0).stdout
    state = next(line for line in status.splitlines() if line.startswith("state:"))
    assert STATE in state and "1 file(s) changed since it was applied" in state, status
    reinstall = f"`{fake_python} -m pip install --force-reinstall --no-deps torch=={BASE.version}`"
    assert "`apply` and `revert` refuse" in state and reinstall in state
    assert "replaces it" not in status
    for command in ("apply", "revert"):
        out = run_cli(command, "--python", fake_python, "--series", two_patches)
        assert out.returncode == 1 and STATE in out.stderr and "Nothing was changed." in out.stderr
        # the series is summarised, not listed patch by patch
        assert "series revision" in out.stderr and ", 2 patches" in out.stderr
        assert "0001-first.patch" not in out.stderr and len(out.stderr) < 400, out.stderr
    assert tree_digest(site) == before


def test_revert_summarises_the_series(site, fake_python, two_patches):
    run_cli("apply", "--python", fake_python, "--series", two_patches, check=0)
    out = run_cli("revert", "--python", fake_python, "--series", two_patches, check=0).stdout
    assert out.strip() == f"reverted series revision {REVISION}, 2 patches"


def test_wheel_install_revert_hint(base_wheel, one_patch, tmp_path):  # noqa: F811
    import subprocess
    import sys

    from torch_patches.wheel.fetch import pip_env
    run_cli("wheel", "--base", base_wheel, "-o", tmp_path / "dist", "--series", one_patch, check=0)
    out = next((tmp_path / "dist").glob("*.whl"))
    target = tmp_path / "target"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--no-compile",
                    "--target", str(target), str(out)], env=pip_env(), check=True, capture_output=True)
    wrapper = python_wrapper(target, tmp_path / "python")
    proc = run_cli("revert", "--python", wrapper, "--series", one_patch)
    assert proc.returncode == 3
    assert f"pip install --force-reinstall --no-deps torch=={BASE.version}" in proc.stderr
    assert f"`pip install torch=={BASE.version}`" in proc.stderr  # why the plain command is not enough
    assert "install the wheel for series revision" not in proc.stderr and "wheel of series revision" not in proc.stderr


def test_bad_base_names_the_file(one_patch, tmp_path, base_wheel):  # noqa: F811
    """A user's own file given as --base is kept, and the message says what it is and what
    --base expects; only a file the tool downloaded into its cache gets the advice to delete it."""
    truncated = tmp_path / base_wheel.name
    truncated.write_bytes(base_wheel.read_bytes()[:4096])
    readme = tmp_path / "README.md"
    readme.write_text("# my notes\n")
    for path, what in ((truncated, "a zip archive that is truncated or damaged"), (readme, "a text file")):
        data = path.read_bytes()
        out = run_cli("wheel", "--base", path, "-o", tmp_path / "dist", "--series", one_patch)
        assert out.returncode == 1 and f"{path} is {what}, not a readable wheel" in out.stderr, out.stderr
        assert f"--base expects the torch {BASE.version} wheel file" in out.stderr
        assert "delete" not in out.stderr.lower() and f"{path} was left as it is" in out.stderr
        assert path.read_bytes() == data
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / base_wheel.name).write_bytes(base_wheel.read_bytes()[:4096])  # an interrupted download
    out = run_cli("wheel", "-o", tmp_path / "dist", "--series", one_patch, env={"TORCH_PATCHES_CACHE": str(cache)})
    assert out.returncode == 1 and str(cache / base_wheel.name) in out.stderr
    assert "Delete that file (the tool downloaded it" in out.stderr, out.stderr
    assert not (tmp_path / "dist").exists()


def test_python_dir_uses_its_bin_python(fake_python, one_patch, tmp_path):
    venv = tmp_path  # fake_python is tmp_path/bin/python
    out = run_cli("status", "--python", venv, "--series", one_patch, check=0).stdout
    assert "pinned base: yes" in out
    empty = tmp_path / "empty-dir"
    empty.mkdir()
    out = run_cli("status", "--python", empty, "--series", one_patch)
    assert out.returncode == 1 and f"{empty / 'bin' / 'python'}" in out.stderr and "Traceback" not in out.stderr


def test_source_tree_without_version_txt(source_tree, one_patch):
    (source_tree / "version.txt").unlink()
    out = run_cli("apply", "--source", source_tree, "--series", one_patch)
    assert out.returncode == 3 and "(is it a PyTorch source tree?). Nothing was changed." in out.stderr
    assert "?." not in out.stderr.replace("?).", "")


def test_help_lists_exit_codes_and_cache(tmp_path):
    cache = tmp_path / "my-cache"
    for argv in (["--help"], ["wheel", "--help"]):
        out = " ".join(run_cli(*argv, check=0, env={"TORCH_PATCHES_CACHE": str(cache)}).stdout.split())
        assert "exit status: 0 success 1 error" in out and "3 refused" in out, out
        assert str(cache) in out and "$TORCH_PATCHES_CACHE" in out and "~/.cache/torch_patches" in out
    wheel_help = run_cli("wheel", "--help", check=0).stdout
    for option in ("--index-url", "--extra-index-url", "--find-links", "--platform", "--python-version",
                   "--abi", "--implementation"):
        assert option in wheel_help



# -- issue 36, point 5: each message from another working directory, with relative paths --------
def _rel(path, cwd) -> str:
    import os
    return os.path.relpath(path, cwd)


def _elsewhere(tmp_path):
    cwd = tmp_path / "elsewhere" / "deeper"
    cwd.mkdir(parents=True, exist_ok=True)
    return cwd


def _install_wheel(wheel, tmp_path):
    """``pip install --target`` of a (small, patched) wheel; an interpreter whose torch it is."""
    import subprocess
    import sys

    from torch_patches.wheel.fetch import pip_env
    target = tmp_path / "target"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--no-compile",
                    "--target", str(target), str(wheel)], env=pip_env(), check=True, capture_output=True)
    return python_wrapper(target, tmp_path / "wheel-venv" / "bin" / "python")


def test_wheel_base_already_patched(base_wheel, one_patch, tmp_path):  # noqa: F811
    """A patched wheel given as --base: one message saying so and naming the base to use, not
    one blob-id mismatch line per file."""
    cwd = _elsewhere(tmp_path)
    run_cli("wheel", "--base", _rel(base_wheel, cwd), "-o", "dist", "--series", _rel(one_patch, cwd),
            check=0, cwd=cwd)
    patched = next((cwd / "dist").glob("*.whl"))
    out = run_cli("wheel", "--base", _rel(patched, cwd), "-o", "dist2", "--series", _rel(one_patch, cwd), cwd=cwd)
    assert out.returncode == 3, (out.stdout, out.stderr)
    assert f"{_rel(patched, cwd)} is already a patched wheel" in out.stderr, out.stderr
    assert f"--base takes the unpatched torch {BASE.version} wheel it was built from" in out.stderr
    assert f"pip download --no-deps torch=={BASE.version}` ({base_wheel.name})" in out.stderr
    assert "blob" not in out.stderr and len(out.stderr.splitlines()) == 1 and "Nothing was written" in out.stderr
    assert not (cwd / "dist2").exists()


def test_python_bin_directory(fake_python, one_patch, tmp_path):
    """--python VENV/bin is accepted (its python); a bin/ without one is named, never VENV/bin/bin/python."""
    cwd = _elsewhere(tmp_path)
    bin_dir = _rel(tmp_path / "bin", cwd)  # fake_python is tmp_path/bin/python
    out = run_cli("status", "--python", bin_dir, "--series", _rel(one_patch, cwd), check=0, cwd=cwd).stdout
    assert "pinned base: yes" in out
    (tmp_path / "empty-venv" / "bin").mkdir(parents=True)
    empty = _rel(tmp_path / "empty-venv" / "bin", cwd)
    out = run_cli("status", "--python", empty, "--series", _rel(one_patch, cwd), cwd=cwd)
    assert out.returncode == 1 and "bin/bin" not in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert f"e.g. --python {empty}/python, or the virtual environment's directory {empty[:-4]}" in out.stderr


def test_status_into_closed_pipe(fake_python, one_patch, tmp_path):
    """`status | head`: the reader goes away before the output is written; no BrokenPipeError
    traceback, exit status 141 (128 + SIGPIPE), as docs/tooling.md says."""
    import os
    import shlex
    import subprocess
    import sys

    from tooling import REPO
    cwd = _elsewhere(tmp_path)
    cmd = " ".join(shlex.quote(a) for a in (sys.executable, "-m", "torch_patches", "status", "--python",
                                            _rel(fake_python, cwd), "--series", _rel(one_patch, cwd)))
    proc = subprocess.run(["bash", "-c", f"{cmd} | (exit 0); echo \"status=${{PIPESTATUS[0]}}\" >&2"],
                          capture_output=True, text=True, cwd=cwd, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert "Traceback" not in proc.stderr and "BrokenPipeError" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == "status=141", proc.stderr
    assert "exit\nstatus 141" in (REPO / "docs" / "tooling.md").read_text() or \
        "exit status 141" in " ".join((REPO / "docs" / "tooling.md").read_text().split())


def test_apply_on_patched_wheel_torch_as_documented(base_wheel, one_patch, two_patches, tmp_path):  # noqa: F811
    """docs/tooling.md and behaviour agree: apply of the series a patched wheel carries exits 0
    ("already applied"), apply of another series and revert exit 3, changing nothing."""
    from tooling import REPO
    cwd = _elsewhere(tmp_path)
    run_cli("wheel", "--base", base_wheel, "-o", "dist", "--series", one_patch, check=0, cwd=cwd)
    python = _rel(_install_wheel(next((cwd / "dist").glob("*.whl")), tmp_path), cwd)
    before = tree_digest(tmp_path / "target")
    out = run_cli("apply", "--python", python, "--series", _rel(one_patch, cwd), check=0, cwd=cwd)
    assert out.stdout.startswith("already applied: torch ") and "installed from the patched wheel" in out.stdout
    assert run_cli("apply", "--python", python, "--series", _rel(two_patches, cwd), check=3, cwd=cwd)
    assert run_cli("revert", "--python", python, "--series", _rel(one_patch, cwd), check=3, cwd=cwd)
    assert tree_digest(tmp_path / "target") == before
    doc = " ".join((REPO / "docs" / "tooling.md").read_text().split())
    assert "installed from the patched wheel` and exits 0, changing nothing" in doc
    assert "`apply` of another series, and `revert`, do not change such a torch in place (exit 3)" in doc


def test_upto_out_of_range_is_bad_usage(fake_python, one_patch, tmp_path):
    cwd = _elsewhere(tmp_path)
    for n in ("99", "0"):
        out = run_cli("apply", "--upto", n, "--python", _rel(fake_python, cwd), "--series", _rel(one_patch, cwd),
                      cwd=cwd)
        assert out.returncode == 2 and f"--upto {n}: the series has 1 patch(es)" in out.stderr, out.stderr


def test_revert_after_hand_edit_prints_reinstall_command(site, fake_python, one_patch, tmp_path):
    """As the patched-wheel message does: the exact command, with the target's interpreter."""
    import os
    cwd = _elsewhere(tmp_path)
    python, series = _rel(fake_python, cwd), _rel(one_patch, cwd)
    run_cli("apply", "--python", python, "--series", series, check=0, cwd=cwd)
    (site / API).write_bytes(edit((site / API).read_bytes(), "by hand"))
    before = tree_digest(site)
    out = run_cli("revert", "--python", python, "--series", series, cwd=cwd)
    command = f"`{os.path.abspath(fake_python)} -m pip install --force-reinstall --no-deps torch=={BASE.version}`"
    assert out.returncode == 1 and API in out.stderr and command in out.stderr, out.stderr
    assert "Nothing was changed." in out.stderr and tree_digest(site) == before
