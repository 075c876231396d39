# Owner(s): ["oncall: distributed"]
"""
Evaluation steps of FSDP stages: eval() runs in the caller's grad mode and
leaves no pending FSDP gradients, also between gradient accumulation steps
and for a plain stage whose children are sharded.

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
    _Base,
)


class TestPipelineStepWorld2(_Base):
    @property
    def world_size(self) -> int:
        return 2

    @parametrize("schedule", ["gpipe", "interleaved_1f1b"])
    def test_accumulate_eval_accumulate(self, schedule: str):
        """Finding 3: step(finalize_gradients=False), eval(), step() trains
        with the reference gradients (as on 2.15.0)."""
        sched = self._build(schedule, "fsdp")
        for it in range(2):
            a, b, e = self._data(3 * it), self._data(3 * it + 1), self._data(3 * it + 2)
            self._run_step(sched, *a, finalize_gradients=False)
            stage_mod = self.modules[min(self.modules)]
            self.assertTrue(stage_mod.has_pending_gradients())
            if 0 in self.modules:
                sched.eval(e[0], target=e[1] if self.last in self.modules else None)
            else:
                sched.eval(target=e[1] if self.last in self.modules else None)
            self._run_step(sched, *b)
            self.assertFalse(stage_mod.has_pending_gradients())
            self._reference_grads([a, b])
            self._assert_grads_match(f"{schedule} step {it}")
            self._optimizer_step()

    @parametrize("dp", ["none", "fsdp"])
    def test_eval_runs_in_callers_grad_mode(self, dp: str):
        """Finding 4: eval() keeps the caller's grad mode (outputs keep their
        grad_fn, as on 2.15.0) and leaves no pending FSDP gradients."""
        sched = self._build("gpipe", dp, aux_loss=True)
        x, y = self._data(0)
        self._run_step(sched, x, y)
        self._reference_grads([(x, y)])
        self._assert_grads_match("before eval")
        self._optimizer_step()
        out = sched.eval(x, target=None) if self.rank == 0 else sched.eval(target=y)
        if self.rank == 1:
            self.assertTrue(out.requires_grad)
        if dp == "fsdp":
            for module in self.modules.values():
                self.assertFalse(module.has_pending_gradients())
        with torch.no_grad():
            out = sched.eval(x, target=None) if self.rank == 0 else sched.eval(target=y)
        if self.rank == 1:
            self.assertFalse(out.requires_grad)
        # The auxiliary loss ran backward in the grad-mode eval (as on 2.15.0)
        for module in self.modules.values():
            module.zero_grad(set_to_none=True)
        # Training continues with the reference gradients
        x, y = self._data(1)
        self._run_step(sched, x, y)
        self._reference_grads([(x, y)])
        self._assert_grads_match("after eval")

    def test_eval_with_sharded_children_accumulating(self):
        """Finding 8: a plain stage module whose children are sharded,
        accumulating with set_requires_gradient_sync(False) across
        finalize_gradients=False steps, can run eval() (revision 2 raised on
        every rank); the accumulation then finishes with nothing pending, and
        training goes on with the reference gradients."""
        sched = self._build("gpipe", "children")
        blocks = [b for m in self.modules.values() for b in m.blocks]
        a, b, e = self._data(0), self._data(1), self._data(2)
        for block in blocks:
            block.set_requires_gradient_sync(False)
        self._run_step(sched, *a, finalize_gradients=False)
        self.assertTrue(any(block.has_pending_gradients() for block in blocks))
        sched.eval(e[0]) if self.rank == 0 else sched.eval(target=e[1])
        for block in blocks:
            block.set_requires_gradient_sync(True)
        self._run_step(sched, *b)
        for block in blocks:
            self.assertFalse(block.has_pending_gradients())
        for module in self.modules.values():
            module.zero_grad(set_to_none=True)
        for p_ref in self.reference.parameters():
            p_ref.grad = None
        for it in range(2):
            x, y = self._data(10 + it)
            self._run_step(sched, x, y)
            self._reference_grads([(x, y)])
            self._assert_grads_match(f"children step {it}")
            self._optimizer_step()

    @parametrize("schedule", ["gpipe", "1f1b"])
    def test_grad_eval_loss_backward_children_no_sync(self, schedule: str):
        """A plain stage module whose sharded children do not sync
        (set_requires_gradient_sync(False)) runs eval() in grad mode with a
        loss that runs backward through the stage output itself: eval()
        leaves no pending gradients on the children, so the training steps
        after it (children syncing again) get the reference gradients, not
        the evaluation's gradients reduced with their own."""
        sched = self._build(schedule, "children")
        blocks = [b for m in self.modules.values() for b in m.blocks]
        loss_fn = sched._loss_fn

        def loss_backward_in_eval(out, target):
            loss = loss_fn(out, target)
            if torch.is_grad_enabled() and not sched._has_backward:
                loss.backward()
            return loss

        sched._loss_fn = loss_backward_in_eval
        x, y = self._data(0)
        self._run_step(sched, x, y)
        self._reference_grads([(x, y)])
        self._assert_grads_match(f"{schedule} before eval")
        self._optimizer_step()
        for block in blocks:
            block.set_requires_gradient_sync(False)
        e = self._data(1)
        sched.eval(e[0]) if self.rank == 0 else sched.eval(target=e[1])
        for block in blocks:
            self.assertFalse(block.has_pending_gradients(), msg=f"{schedule} after eval")
            block.set_requires_gradient_sync(True)
        for module in self.modules.values():
            module.zero_grad(set_to_none=True)
        for it in range(2):
            x, y = self._data(10 + it)
            self._run_step(sched, x, y)
            self._reference_grads([(x, y)])
            self._assert_grads_match(f"{schedule} step {it} after eval")
            self._optimizer_step()


instantiate_parametrized_tests(TestPipelineStepWorld2)


if __name__ == "__main__":
    run_tests()
