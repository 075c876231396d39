"""test/conftest.py: a skip under test/distributed/ fails; elsewhere it stays a skip."""

import shutil
import subprocess
import sys

from tooling import REPO


def test_skips_under_distributed_fail(tmp_path):
    shutil.copy(REPO / "test" / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "distributed").mkdir()
    (tmp_path / "distributed" / "test_lifecycle.py").write_text(
        "import unittest, pytest\n"
        "def test_skip():\n    pytest.skip('fewer GPUs than ranks')\n"
        "class T(unittest.TestCase):\n"
        "    @unittest.skip('no accelerator')\n    def test_unittest_skip(self): pass\n"
        "    def test_ok(self): pass\n"
        "@pytest.mark.xfail(reason='known')\ndef test_xfail():\n    assert False\n")
    (tmp_path / "tools").mkdir()
    (tmp_path / "tools" / "test_tool.py").write_text(
        "import pytest\ndef test_skip():\n    pytest.skip('fine here')\n")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rA", str(tmp_path)],
                          capture_output=True, text=True, cwd=tmp_path)
    out = proc.stdout
    assert proc.returncode == 1, out
    assert "2 failed" in out and "1 passed" in out and "1 skipped" in out and "1 xfailed" in out, out
    assert "count as failures" in out
    # a module-level skip is a collection error
    (tmp_path / "distributed" / "test_module_skip.py").write_text(
        "import pytest\npytest.skip('module level', allow_module_level=True)\n")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           str(tmp_path / "distributed" / "test_module_skip.py")],
                          capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode != 0 and "count as failures" in proc.stdout, proc.stdout
