# Owner(s): ["oncall: distributed"]
"""
The failure cases of test_pipelining_fsdp_failure.py for stages that are
plain containers of FSDP blocks under zero-bubble schedules
(InterleavedZeroBubble, ZBV, DualPipeV): a failure on one rank makes its peer
raise as fast as on 2.15.0 whether the failed rank exits or stays alive (and
then its next step is refused). Such stages compute their weight gradients
only with the container-stage PR (0024), which the checks of the steps before
the failure compare with the reference, so these cases ship with the
failed-step container PR (0025) rather than with 0021.

Gloo on CPU. The model, schedules and helpers are those of
test_pipelining_fsdp_step.py and test_pipelining_fsdp_failure.py.
"""

from torch.testing._internal.common_utils import (
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
)

from test_pipelining_fsdp_failure import (
    _OneRankFailureBase,
    _PeerFailsFastBase,
    ZERO_BUBBLE,
)


class TestZeroBubbleContainerPeerFailsFast(_PeerFailsFastBase):
    @parametrize("schedule", list(ZERO_BUBBLE))
    def test_peer_of_a_rank_that_fails_alone_fails_fast(self, schedule: str):
        self._check_peer_fails_fast(schedule, "children")


class TestZeroBubbleContainerOneRankFailure(_OneRankFailureBase):
    @parametrize("schedule", list(ZERO_BUBBLE))
    def test_one_rank_failure_fails_fast_and_refuses_the_next_step(self, schedule: str):
        self._check_schedule(schedule, ("children",))


instantiate_parametrized_tests(TestZeroBubbleContainerPeerFailsFast)
instantiate_parametrized_tests(TestZeroBubbleContainerOneRankFailure)


if __name__ == "__main__":
    run_tests()
