"""docs/api.md's "Seeing each group's reductions" runs as written.

Both ``bash`` commands of the section run unchanged (``python`` is this test's
interpreter, whose torch has the series applied) and print exactly the sample
output that follows each: one ``FSDP::post_backward_reduce`` line per FSDP group
per step with ``partial_backward()``, four for ``lm_head`` without it. Without
``TORCH_LOGS`` the example prints no reduction line (FSDP's default output is
unchanged).
"""

import os
import re
import subprocess
import sys

from tooling import REPO

DOC = REPO / "docs" / "api.md"
SECTION = "## Seeing each group's reductions"


def _commands_and_samples() -> list[tuple[str, str]]:
    text = DOC.read_text()
    section = text[text.index(SECTION):]
    section = section[: section.index("\n## ", len(SECTION))]
    blocks = re.findall(r"```(\w*)\n(.*?)```", section, re.S)
    pairs = []
    for (lang, body), (next_lang, next_body) in zip(blocks, blocks[1:]):
        if lang == "bash" and next_lang == "":
            pairs.append((body.strip(), next_body))
    return pairs


def _run(command: str, **env: str) -> subprocess.CompletedProcess:
    path = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    return subprocess.run(["bash", "-c", command], cwd=REPO, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "PATH": path, **env})


def test_documented_commands_print_the_documented_reductions():
    pairs = _commands_and_samples()
    assert [("--no-partial-backward" in command) for command, _ in pairs] == [False, True]
    per_step = []
    for command, sample in pairs:
        # Unbuffered, as CI may run it: each write reaches the shared pipe at once,
        # so a line written in two parts could be split by the other rank's log.
        proc = _run(command, PYTHONUNBUFFERED="1")
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout == sample, (command, proc.stdout, proc.stderr)
        steps = proc.stdout.split("step ")[:-1]
        per_step.append([step.count("(lm_head)") for step in steps])
    assert per_step == [[1, 1], [4, 4]]


def test_no_reduction_log_by_default():
    env = {k: v for k, v in os.environ.items() if k != "TORCH_LOGS"}
    path = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    proc = subprocess.run([sys.executable, "tools/examples/reduction_log.py", "--steps", "1",
                           "--no-partial-backward"], cwd=REPO, capture_output=True, text=True,
                          timeout=600, env={**env, "PATH": path})
    assert proc.returncode == 0, proc.stderr
    assert "post_backward" not in proc.stdout + proc.stderr
    assert "step 1" in proc.stderr
