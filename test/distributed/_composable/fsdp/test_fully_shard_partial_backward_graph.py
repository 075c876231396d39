# Owner(s): ["oncall: distributed"]
"""
Tests that a ``FSDPModule.partial_backward(outer_backward=True)`` exit reads
from the autograd graph whether the outer backward reaches a group: a forward
whose output the graph no longer holds (a detached metric call) does not make
a separately sharded head a group of the outer backward.

The models and helpers are those of test_fully_shard_partial_backward_exit.py.
Every multi-process test runs gloo on CPU through ``GlooMultiProcessTestCase``.
"""

import os
import sys

import torch
from torch.testing._internal.common_utils import (
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
)


sys.path.insert(
    0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
)
from fsdp_lifecycle_testing import (  # noqa: E402
    GlooMultiProcessTestCase,
    random_token_microbatches,
)
from test_fully_shard_lifecycle import (  # noqa: E402
    _DecoderBackwardProbe,
    _head_group,
    _microbatch_policy,
    _Recorder,
    BATCH_SIZE,
    HEAD_LAYOUTS,
    LR,
    NUM_MICROBATCHES,
    NUM_STEPS,
    SEQ_LEN,
    VOCAB_SIZE,
)
from test_fully_shard_partial_backward_exit import (  # noqa: E402
    _make_rootless_models,
    _microbatch,
    _PartialBackwardReachMixin,
    PROGRAMS,
)


class TestFullyShardPartialBackwardGraphReach(
    _PartialBackwardReachMixin, GlooMultiProcessTestCase
):
    """
    A grad-enabled head call on the last position before the scope, whose
    output is detached, does not make the outer backward reach a separate
    head, for separate, grouped and tied heads, with the scope on ``lm_head``
    and on the root: during the decoder backward the head holds what it holds
    in the non-chunked program and its reduce-scatter was issued as often,
    and the gradients and parameters match a float64 single-process
    reference over several optimizer steps. Keyed on the earlier forward, the
    exit kept the separate head's 2048 B gradient through the decoder
    backward and issued its reduce-scatter in the final callback.
    """

    @parametrize("layout", list(HEAD_LAYOUTS))
    def test_detached_head_call_outside_scope(self, layout: str):
        mesh = self._mesh()
        # (program, whether each microbatch makes the detached head call)
        runs = [("full", True)] + [(p, c) for p in PROGRAMS[1:] for c in (True, False)]
        models, ref = {}, None
        for run in runs:
            models[run], ref = _make_rootless_models(layout, mesh)
        optims = {r: torch.optim.SGD(m.parameters(), lr=LR) for r, m in models.items()}
        ref_optim = torch.optim.SGD(ref.parameters(), lr=LR)
        recorders = {r: _Recorder(m) for r, m in models.items()}
        probes = {
            r: _DecoderBackwardProbe(m, _head_group(m), recorders[r])
            for r, m in models.items()
        }
        for step in range(NUM_STEPS):
            tokens, labels = random_token_microbatches(
                100 * step + self.rank, NUM_MICROBATCHES, VOCAB_SIZE, BATCH_SIZE, SEQ_LEN
            )
            # Per microbatch, during each decoder block's backward: the head's
            # unsharded parameter and gradient bytes and its reduce-scatters
            samples: dict[tuple[str, bool], list[list[tuple[int, int, int]]]] = {}
            for (program, metric_call), model in models.items():
                recorder, probe = recorders[program, metric_call], probes[program, metric_call]
                head = _head_group(model)
                with recorder.record():
                    for mb in range(NUM_MICROBATCHES):
                        probe.samples.clear()
                        probe.start = recorder.reduce_scatters[head]
                        # No-sync microbatches, then a reducing one
                        with _microbatch_policy(model, "on", mb):
                            _microbatch(
                                model,
                                program,
                                tokens[mb],
                                labels[mb],
                                metric_call=metric_call,
                            )
                        samples.setdefault((program, metric_call), []).append(
                            list(probe.samples)
                        )
            self._reference_step(ref, tokens, labels)
            for run, model in models.items():
                self._assert_close_to_reference(model, ref, "grad", f"step {step}, {run}")
                optims[run].step()
                optims[run].zero_grad()
            ref_optim.step()
            ref_optim.zero_grad()
            for run, model in models.items():
                self._assert_close_to_reference(model, ref, "param", f"step {step}, {run}")

            def position(samples):
                # Bytes held and whether the head's reduction was issued. The
                # tied group is reduced at the embedding's backward, after the
                # decoder's (the non-chunked program also reduces the head's
                # share when autograd leaves ``lm_head``): compare its weight
                return [
                    [s[0] if layout == "tied" else (s[0], s[1], s[2] > 0) for s in mb]
                    for mb in samples
                ]

            for program in PROGRAMS[1:]:
                where = f"step {step}, {program}"
                # The detached call changes nothing
                self.assertEqual(
                    samples[program, True], samples[program, False], where
                )
                self.assertEqual(
                    position(samples[program, True]),
                    position(samples["full", True]),
                    where,
                )
            if layout == "separate":
                # Resharded and, on the reducing microbatch, reduced before
                # the decoder backward, as without chunking
                num_layers = len(ref.layers)
                head_grad_bytes = ref.lm_head.weight.numel() * 4
                for program in PROGRAMS:
                    self.assertEqual(
                        samples[program, True],
                        [[(0, head_grad_bytes, 0)] * num_layers]
                        * (NUM_MICROBATCHES - 1)
                        + [[(0, 0, 1)] * num_layers],
                        program,
                    )



instantiate_parametrized_tests(TestFullyShardPartialBackwardGraphReach)


if __name__ == "__main__":
    run_tests()
