# Owner(s): ["oncall: distributed"]
"""
Retrying a pipeline step that raised: after zero_grad() the retry trains
with the reference gradients (bitwise equal to a clean run when every stage
is on one rank), and a failed step after gradient accumulation warns that
the accumulation must be rerun.

Gloo on CPU; gradients are compared with a single-process reference over
several optimizer steps. The model, schedules and helpers are those of
test_pipelining_fsdp_step.py.
"""

import warnings

import torch
import torch.distributed as dist
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


class TestPipelineStepWorld2(_Base):
    @property
    def world_size(self) -> int:
        return 2

    @parametrize("schedule", ["gpipe", "1f1b"])
    @parametrize("dp", ["none", "fsdp"])
    def test_retry_after_failure_every_rank(self, schedule: str, dp: str):
        """Findings 5 and 6 across ranks: the last stage's loss raises at
        microbatch 0 and stage 0's forward at microbatch 1, after the last
        stage has received microbatch 0, so that each rank raises with none
        of the step's sends or receives in flight; after zero_grad() the retry
        trains with the reference gradients and returns every loss. The
        single-rank test below covers every schedule bitwise."""
        sched = self._build(schedule, dp)
        sync = dist.FileStore(f"{self.file_name}.sync", self.world_size)
        first, fail = self._inject_failures(sched, sync)
        for it in range(2):
            x, y = self._data(it)
            if it == 1:
                fail["armed"] = True
                # GPipe wraps a forward's error in a RuntimeError
                with self.assertRaises(Exception):
                    self._run_step(sched, x, y, losses=[])
                fail["armed"] = False
                for module in self.modules.values():
                    module.zero_grad(set_to_none=True)
            losses: list = []
            self._run_step(sched, x, y, losses=losses)
            self._reference_grads([(x, y)])
            self._assert_grads_match(f"{schedule} {dp} step {it}")
            self._optimizer_step()
            if self.last in self.modules:
                self.assertEqual(len(losses), NUM_MICROBATCHES)


class TestPipelineStepWorld1(_Base):
    """Every stage on one rank, so a failure raises on every rank of the
    pipeline at once, at any point (also in metadata inference)."""

    @property
    def world_size(self) -> int:
        return 1

    @parametrize(
        "schedule",
        ["gpipe", "1f1b", "interleaved_1f1b", "interleaved_zb", "zbv"],
    )
    def test_retry_is_bitwise_equal_to_clean_run(self, schedule: str):
        for dp in ("none", "fsdp"):
            for where in ("forward", "loss_mb0", "loss_mb1", "metadata"):
                self._check(schedule, dp, where)

    @parametrize("schedule", ["gpipe", "interleaved_1f1b"])
    def test_failed_step_after_accumulation_warns(self, schedule: str):
        """Point 3 of revision 4: step(a, finalize_gradients=False), then a
        step(b) that raises: clearing the failed step discards a's pending
        gradients, and the schedule warns that the accumulation must be rerun
        from its first step (revision 3 discarded them silently; the final
        gradients were ref(b + c), 2.5e-1 off ref(a + b + c)). Rerunning it
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
                    with self.assertRaises(Failure, msg=msg):
                        self._run_step(sched, *b, finalize_gradients=False)
                fail["armed"] = False
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


instantiate_parametrized_tests(TestPipelineStepWorld2)
instantiate_parametrized_tests(TestPipelineStepWorld1)


if __name__ == "__main__":
    run_tests()
