# Owner(s): ["oncall: distributed"]
"""
Retrying a pipeline step that raised, every stage on one rank: after
zero_grad() the retry is bitwise equal to a clean run, and a failed step
after gradient accumulation says every time that the accumulation must be
rerun. Failures across ranks: test_pipelining_fsdp_failure.py.

Gloo on CPU; gradients are compared with a single-process reference over
several optimizer steps. The model, schedules and helpers are those of
test_pipelining_fsdp_step.py.
"""

import warnings

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.testing._internal.common_utils import (
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
)

from test_pipelining_fsdp_step import (
    Failure,
    NUM_MICROBATCHES,
    _Base,
)


class TestPipelineStepWorld1(_Base):
    """Every stage on one rank, so a failure raises on every rank of the
    pipeline at once, at any point (also in metadata inference)."""

    @property
    def world_size(self) -> int:
        return 1

    @parametrize(
        "schedule",
        ["gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "interleaved_zb", "zbv", "dualpipev"],
    )
    def test_retry_is_bitwise_equal_to_clean_run(self, schedule: str):
        """A retry after zero_grad() equals a clean run bitwise, every
        schedule (LoopedBFS: the failed step's same-rank receive buffers are
        dropped; 2.15.0 raised "Receive buffer ... still owned")."""
        for dp in ("none", "fsdp"):
            for where in ("forward", "loss_mb0", "loss_mb1", "metadata"):
                self._check(schedule, dp, where)

    @parametrize("schedule", ["gpipe", "interleaved_1f1b"])
    def test_failed_step_after_accumulation_warns(self, schedule: str):
        """Point 3 of revision 4: step(a, finalize_gradients=False), then a
        step(b) that raises: clearing the failed step discards a's pending
        gradients, and the schedule warns that the accumulation must be rerun
        from its first step, in a note on the exception too (revision 3
        discarded them silently; the final gradients were ref(b + c), 2.5e-1
        off ref(a + b + c)). Rerunning it
        after zero_grad() trains with the reference gradients; a failed step
        with nothing accumulated does not warn."""
        for dp in ("none", "fsdp"):
            # A plain stage scales its whole .grad at the end of every step:
            # it accumulates across steps with scale_grads=False
            sched = self._build(schedule, dp, scale_grads=dp != "none")
            loss_fn = sched._loss_fn
            fail = {"armed": False}

            def reference_grads(batches):
                self._reference_grads(batches)
                if dp == "none":
                    for p_ref in self.reference.parameters():
                        if p_ref.grad is not None:
                            p_ref.grad.mul_(NUM_MICROBATCHES)

            def failing_loss(out, target):
                if fail["armed"]:
                    raise Failure("injected loss failure")
                return loss_fn(out, target)

            sched._loss_fn = failing_loss
            for it in range(2):
                msg = f"{schedule} {dp} step {it}"
                a, b, c = (self._data(3 * it + k) for k in range(3))
                self._run_step(sched, *a, finalize_gradients=False)
                fail["armed"] = True
                with self.assertWarnsRegex(UserWarning, "rerun the gradient accumulation", msg=msg):
                    with self.assertRaises(Failure, msg=msg) as raised:
                        self._run_step(sched, *b, finalize_gradients=False)
                fail["armed"] = False
                # The exception says so too
                notes = getattr(raised.exception, "__notes__", [])
                self.assertTrue(
                    any("rerun the gradient accumulation" in note for note in notes), msg=msg
                )
                for module in self.modules.values():
                    if isinstance(module, FSDPModule):
                        self.assertFalse(module.has_pending_gradients(), msg=msg)
                    module.zero_grad(set_to_none=True)
                self._run_step(sched, *a, finalize_gradients=False)
                self._run_step(sched, *b)
                reference_grads([a, b])
                self._assert_grads_match(msg)
                self._optimizer_step()
                fail["armed"] = True
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    with self.assertRaises(Failure, msg=msg):
                        self._run_step(sched, *c)
                self.assertFalse(
                    [w for w in caught if "gradient accumulation" in str(w.message)], msg=msg
                )
                fail["armed"] = False
                for module in self.modules.values():
                    module.zero_grad(set_to_none=True)
                self._run_step(sched, *c)
                reference_grads([c])
                self._assert_grads_match(msg)
                self._optimizer_step()

    def test_every_discarded_accumulation_is_shown(self):
        """Issue 34 point 3: under Python's default warning filters, a loop
        that discards an accumulation twice from one call site shows the
        warning twice (revision 4: once per process, the second discard was
        silent unless the exception was printed)."""
        sched = self._build("gpipe", "fsdp")
        loss_fn = sched._loss_fn
        fail = {"armed": False}

        def failing_loss(out, target):
            if fail["armed"]:
                raise Failure("injected loss failure")
            return loss_fn(out, target)

        sched._loss_fn = failing_loss
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("default")
            for it in range(2):
                a, b = self._data(2 * it), self._data(2 * it + 1)
                for batch, armed in ((a, False), (b, True)):
                    fail["armed"] = armed
                    try:
                        self._run_step(sched, *batch, finalize_gradients=False)
                    except Failure:
                        pass
                fail["armed"] = False
                for module in self.modules.values():
                    module.zero_grad(set_to_none=True)
        shown = [w for w in caught if "rerun the gradient accumulation" in str(w.message)]
        self.assertEqual(len(shown), 2)

    def _check(self, schedule: str, dp: str, where: str) -> None:
        msg = f"{schedule} {dp} {where}"
        runs = []
        for inject in (False, True):
            sched = self._build(schedule, dp)
            loss_fn = sched._loss_fn
            state = {"calls": 0, "fail_at": None, "forward": False}

            def failing_loss(out, target):
                state["calls"] += 1
                if state["calls"] == state["fail_at"]:
                    raise Failure("injected loss failure")
                return loss_fn(out, target)

            def failing_hook(module, args):
                if state["forward"]:
                    raise Failure("injected forward failure")

            sched._loss_fn = failing_loss
            self.modules[0].register_forward_pre_hook(failing_hook)
            grads_per_step = []
            for it in range(2):
                x, y = self._data(it)
                # The first step's first loss call is metadata inference's
                fail_step = 0 if where == "metadata" else 1
                if inject and it == fail_step:
                    state["calls"] = 0
                    state["fail_at"] = {"metadata": 1, "loss_mb0": 1, "loss_mb1": 2}.get(where)
                    state["forward"] = where == "forward"
                    with self.assertRaises(Failure if where != "forward" else RuntimeError, msg=msg):
                        self._run_step(sched, x, y, losses=[])
                    state["fail_at"], state["forward"] = None, False
                    for module in self.modules.values():
                        module.zero_grad(set_to_none=True)
                losses: list = []
                self._run_step(sched, x, y, losses=losses)
                self.assertEqual(len(losses), NUM_MICROBATCHES, msg=msg)
                grads = {
                    f"{i}.{n}": (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
                    for i, m in self.modules.items()
                    for n, p in m.named_parameters()
                    if p.grad is not None
                }
                grads_per_step.append(([l.detach().clone() for l in losses], grads))
                self._reference_grads([(x, y)])
                self._assert_grads_match(f"{msg} step {it} inject={inject}")
                self._optimizer_step()
            runs.append(grads_per_step)
        for (clean_losses, clean_grads), (losses, grads) in zip(*runs):
            self.assertEqual(len(clean_losses), len(losses), msg=msg)
            for a, b in zip(clean_losses, losses):
                self.assertTrue(torch.equal(a, b), msg=msg)
            self.assertEqual(sorted(clean_grads), sorted(grads), msg=msg)
            for name in clean_grads:
                self.assertTrue(torch.equal(clean_grads[name], grads[name]), msg=f"{msg} {name}")


instantiate_parametrized_tests(TestPipelineStepWorld1)


if __name__ == "__main__":
    run_tests()
