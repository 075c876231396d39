"""Open finding (2026-12-05): pipeline stages with static metadata and an FSDP stage module.

``PipelineStage(..., input_args=..., output_args=...)`` runs no metadata-inference probe, and
with it none of the cleanup at the train/eval switch. GPipe, PP2 x DP2, the model of
genlib_pp (FSDP stage modules): ``step(finalize_gradients=False)``, ``eval()``, ``step()``
accumulates wrong gradients (max error 1.7e-2 to 7.5e-2 across runs and ranks), and ``step()``, ``eval()`` leaves
the sharded parameters without gradients at the optimizer step; on pristine 2.15.0 and on the
series alike (docs/parity.md, "Not covered, and wrong on both torches"). With dynamic metadata
(no input_args) both sequences are right: ``STATIC=0 python THIS_FILE`` passes.

Run: python THIS_FILE, from any directory; exits 1 with FAILED: ... while the bug is there.
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # tools/parity
from genlib_pp import *  # noqa: E402,F401,F403 - the model, reference, checks
from genscript import main  # noqa: E402


def body(rank, world, ctx):
    if os.environ.get("STATIC", "1") == "1":
        dynamic = pipelining.PipelineStage

        def static(mod, i, n, device, group=None):
            x = torch.zeros(MB, S, dtype=torch.long) if i == 0 else torch.zeros(MB, S, D, requires_grad=True)
            y = torch.zeros(MB, S, V if i == n - 1 else D, requires_grad=True)
            return dynamic(mod, i, n, device, input_args=(x,), output_args=(y,), group=group)

        pipelining.PipelineStage = static
    pipe = Pipe(ctx, rank, world, "ScheduleGPipe", "single", "fsdp", n_mb=4)
    pipe.run(0)
    pipe.optim_step("step 0")
    pipe.run(1, finalize_gradients=False)
    with torch.no_grad():
        pipe.run(50, eval_mode=True)
    pipe.run(2)
    pipe.optim_step("accumulation with eval() between")
    pipe.run(3)
    with torch.no_grad():
        pipe.run(51, eval_mode=True)
    pipe.optim_step("eval() between step and optimizer step")


if __name__ == "__main__":
    main(body, world=4)
