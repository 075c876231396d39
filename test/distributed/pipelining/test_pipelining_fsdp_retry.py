# Owner(s): ["oncall: distributed"]
"""
Retrying a pipeline step whose metadata inference raised on some ranks after
the cross-rank inference-mode vote (in stage 0's probe forward, before any
pipeline communication): the failed ranks rejoin their peers, which wait in
their first receive, and FSDP keeps no trace of the failed probe.

World 4 = PP2 x FSDP2, gloo on CPU; builds on the pipelines of
``test_pipelining_fsdp_lifecycle.py``.
"""

import os
import sys

from torch.distributed.fsdp import FSDPPolicy
from torch.testing._internal.common_utils import run_tests


sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_pipelining_fsdp_lifecycle import (  # noqa: E402
    pending_fsdp_state,
    PipelineBuild,
    PipelineFSDPTestBase,
)


class TestPipeliningFSDPRetry(PipelineFSDPTestBase):
    def test_metadata_inference_failure_then_retry(self):
        """
        A step whose metadata inference raises leaves the caller's policy and
        no FSDP state behind; retrying it gives exactly the result of a clean
        run, with one reduce-scatter per group.
        """
        self.run_subtests(
            {"schedule_name": ["1f1b", "zbv"]}, self._test_failure_then_retry
        )

    def _test_failure_then_retry(self, schedule_name: str) -> None:
        policy = FSDPPolicy(reshard_after_backward=False)
        clean = PipelineBuild(self.rank, schedule_name, "grouped", False, policy)
        self.assertEqual(clean.step(0), clean.num_groups)
        clean_grads = {
            name: param.grad.full_tensor() for name, param in clean.params.items()
        }

        build = PipelineBuild(self.rank, schedule_name, "grouped", False, policy)
        if build.has_first:
            # The first layer of stage 0 raises in its first forward (after
            # FSDP unsharded it): the probe forward of metadata inference,
            # which runs before any pipeline communication. Every rank holding
            # stage 0 fails there; the other ranks wait for the retry in their
            # first receive.
            def fail_once(module, args):
                handle.remove()
                raise RuntimeError("injected metadata inference failure")

            handle = build.stage_mods[0].layers["0"].register_forward_pre_hook(
                fail_once
            )
            with self.assertRaisesRegex(RuntimeError, "injected"):
                build.step(0)
            self.assertEqual(build.policies(), [policy] * len(build.fsdp_modules))
            for stage_mod in build.stage_mods.values():
                self.assertEqual(pending_fsdp_state(stage_mod), [])
        self.assertEqual(build.step(0), build.num_groups)
        self.assertEqual(build.policies(), [policy] * len(build.fsdp_modules))
        for name, param in build.params.items():
            self.assertEqual(
                param.grad.full_tensor(), clean_grads[name], atol=0, rtol=0, msg=name
            )
        self._check_loss(build)
        build.check_grads_and_update(self)


if __name__ == "__main__":
    run_tests()
