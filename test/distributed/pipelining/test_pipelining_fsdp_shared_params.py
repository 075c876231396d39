# Owner(s): ["oncall: distributed"]
"""
A parameter that two stages of a rank share (tied weights) keeps its
gradient across an eval() between two steps: metadata inference, run again at
the switch to eval and back, leaves the shared gradient as it found it, for
plain, FSDP and sharded-children stages.

Gloo on CPU; gradients are compared with a single-process reference over
several optimizer steps. The model, schedules and helpers are those of
test_pipelining_fsdp_step.py.
"""

import torch
from torch.testing._internal.common_utils import (
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
)

from test_pipelining_fsdp_step import (
    NUM_MICROBATCHES,
    _Base,
)


class TestPipelineSharedParameters(_Base):
    """Four stages on two ranks; stage s and stage s + 2 (on the same rank)
    share one ``shared`` layer (tied weights)."""

    @property
    def world_size(self) -> int:
        return 2

    @parametrize("schedule", ["interleaved_1f1b", "looped_bfs"])
    @parametrize("dp", ["none", "fsdp", "children"])
    def test_eval_keeps_shared_parameter_gradients(self, schedule: str, dp: str):
        """Point 1 of revision 4: step(a), eval(e), step(b) with
        scale_grads=False accumulates ref(a + b) into every parameter,
        including one that two stages of this rank share: metadata inference
        (run again at the switch to eval and back) leaves the shared gradient
        exactly as it found it. (Revision 3: the tied gradient was None after
        the eval and the final one off by 2e-1.)"""
        sched = self._build_tied(schedule, dp)
        for it in range(2):
            a, e, b = self._data(3 * it), self._data(3 * it + 1), self._data(3 * it + 2)
            self._run_step(sched, *a)
            before = self._tied_grads()
            self.assertTrue(all(g is not None for g in before))
            with torch.no_grad():
                if self.rank == 0:
                    sched.eval(e[0])
                else:
                    sched.eval(target=e[1])
            after = self._tied_grads()
            for g_before, g_after in zip(before, after):
                self.assertIsNotNone(g_after, msg=f"{schedule} {dp} step {it}")
                self.assertTrue(torch.equal(g_before, g_after), msg=f"{schedule} {dp} step {it}")
            self._run_step(sched, *b)
            self._reference_grads([a, b])
            for p_ref in self.reference.parameters():
                if p_ref.grad is not None:
                    # scale_grads=False: the sum over the microbatches
                    p_ref.grad.mul_(NUM_MICROBATCHES)
            self._assert_grads_match(f"{schedule} {dp} step {it}")
            self._optimizer_step()


instantiate_parametrized_tests(TestPipelineSharedParameters)


if __name__ == "__main__":
    run_tests()
