# Owner(s): ["oncall: distributed"]
"""
eval() of single-stage schedules (GPipe, 1F1B) leaves every gradient as it
found it: between a step and the optimizer step, and between gradient
accumulation steps, for FSDP stages and plain containers of FSDP blocks.

Gloo on CPU; gradients are compared with a single-process reference over
several optimizer steps. The model, schedules and helpers are those of
test_pipelining_fsdp_step.py; the world-4 accumulation test below, which also
counts the all-gathers of the evaluation (the metadata probe resets nothing
while gradients are pending), uses test_pipelining_fsdp_lifecycle.py's.
"""

import torch
from torch.distributed.fsdp import FSDPPolicy
from torch.testing._internal.common_utils import (
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
)

from test_pipelining_fsdp_lifecycle import PipelineBuild, PipelineFSDPTestBase
from test_pipelining_fsdp_step import (
    NUM_MICROBATCHES,
    _Base,
)


class TestPipelineSharedParameters(_Base):
    @property
    def world_size(self) -> int:
        return 2

    @parametrize("schedule", ["gpipe", "1f1b", "interleaved_1f1b"])
    @parametrize("dp", ["fsdp", "children"])
    def test_eval_between_accumulation_steps(self, schedule: str, dp: str):
        """Point 7 of revision 4: step(a, finalize_gradients=False), eval(e),
        step(b) accumulates ref(a + b), for an FSDP stage (also in the FSDP
        root's group, whose
        unsharded parameters stay registered between the steps) and a plain
        container of FSDP blocks (2.15.0 and revision 3: eval() of GPipe and
        1F1B scaled every registered .grad by
        1/n_microbatches, losing 3/4 of a's gradient there, max error 2.8e-1
        in a one-stage GPipe)."""
        # A container stage is not an FSDP stage for the schedule: each step
        # scales its .grad, so it accumulates across steps only with
        # scale_grads=False (as a plain stage, on 2.15.0 too)
        scale_grads = dp == "fsdp"
        sched = self._build_tied(schedule, dp, tie=False, scale_grads=scale_grads)
        for it in range(2):
            a, e, b = self._data(3 * it), self._data(3 * it + 1), self._data(3 * it + 2)
            self._run_step(sched, *a, finalize_gradients=False)
            with torch.no_grad():
                sched.eval(e[0]) if self.rank == 0 else sched.eval(target=e[1])
            self._run_step(sched, *b)
            self._reference_grads([a, b])
            if not scale_grads:
                for p_ref in self.reference.parameters():
                    if p_ref.grad is not None:
                        p_ref.grad.mul_(NUM_MICROBATCHES)
            self._assert_grads_match(f"{schedule} {dp} step {it}")
            self._optimizer_step()

    @parametrize("schedule", ["gpipe", "1f1b"])
    def test_eval_after_step_leaves_plain_gradients(self, schedule: str):
        """Point 7 of revision 4: eval() between a step and the optimizer
        step leaves a plain stage's gradients as they were (2.15.0 and
        revision 3 divided them by n_microbatches)."""
        sched = self._build_tied(schedule, "none", tie=False, scale_grads=True)
        for it in range(2):
            x, y = self._data(2 * it)
            self._run_step(sched, x, y)
            e = self._data(2 * it + 1)
            with torch.no_grad():
                sched.eval(e[0]) if self.rank == 0 else sched.eval(target=e[1])
            self._reference_grads([(x, y)])
            self._assert_grads_match(f"{schedule} step {it}")
            self._optimizer_step()


instantiate_parametrized_tests(TestPipelineSharedParameters)


class TestPipeliningFSDPEvalBetweenAccumulationSteps(PipelineFSDPTestBase):
    def test_probe_resets_nothing_while_gradients_are_pending(self):
        """
        ``step(finalize_gradients=False)``, ``eval()``, ``eval()``, ``step()``
        per optimizer step: the first ``eval()`` switches from training and
        reruns metadata inference, whose FSDP reset must not run while the
        accumulation is pending (it would discard the root's iteration state
        and all-gather the root again), so it all-gathers exactly what the
        second ``eval()`` (no switch, no probe) does; the accumulated
        gradients equal the reference's (0022: eval() leaves them unscaled).
        World 4 (PP2 x DP2) with the chunked loss of
        test_pipelining_fsdp_lifecycle.py; the grouped head completes its
        forward with ``finish_forward``, so both evaluations start from the
        same residency (with the reset, the first all-gathers the stage module
        once more).
        """
        self.run_subtests(
            {"schedule_name": ["gpipe", "1f1b"], "head": ["grouped"]},
            self._test_eval_between_accumulation_steps,
        )

    def _test_eval_between_accumulation_steps(self, schedule_name: str, head: str):
        build = PipelineBuild(self.rank, schedule_name, head, False, FSDPPolicy())
        build.step(0)
        build.check_grads_and_update(self)
        for it in range(2):
            build.step(1 + 3 * it, finalize_gradients=False)
            all_gathers = []
            for data_step in (2 + 3 * it, 100 + it):
                args, kwargs = build.schedule_inputs(data_step)
                build.counter.reset()
                with build.counter.count(), torch.no_grad():
                    build.schedule.eval(*args, **kwargs)
                all_gathers.append(build.counter["all_gather"])
            self.assertEqual(
                all_gathers[0],
                all_gathers[1],
                msg=f"{schedule_name} {head} rank {self.rank}: all-gathers of the "
                "eval() after step(finalize_gradients=False) vs the next eval()",
            )
            build.step(3 + 3 * it)
            self._check_loss(build)
            build.check_grads_and_update(self)


if __name__ == "__main__":
    run_tests()
