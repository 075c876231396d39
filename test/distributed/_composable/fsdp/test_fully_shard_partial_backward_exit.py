# Owner(s): ["oncall: distributed"]
"""
Tests for the exit of ``FSDPModule.partial_backward(outer_backward=True)``:
the groups the decoder backward does not reach are reduced and resharded per
the caller's policy before the first decoder block's backward, observed with
``FSDPModule.unsharded_parameters`` and ``FSDPModule.has_pending_gradients``.

The models and the test mixin are those of test_fully_shard_lifecycle.py.
Every multi-process test runs gloo on CPU through ``GlooMultiProcessTestCase``.
"""

import os
import sys

import torch
from torch.distributed.fsdp._fully_shard import _fsdp_param_group
from torch.testing._internal.common_utils import (
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
)


sys.path.insert(
    0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
)
from fsdp_lifecycle_testing import (  # noqa: E402
    fsdp_param_groups,
    GlooMultiProcessTestCase,
    param_group_name,
    random_token_microbatches,
)
from test_fully_shard_lifecycle import (  # noqa: E402
    BATCH_SIZE,
    LR,
    NUM_MICROBATCHES,
    SEQ_LEN,
    VOCAB_SIZE,
    _LifecycleTestMixin,
    _Recorder,
    _chunked_loss_step,
    _head_group,
    _make_models,
    _microbatch_policy,
)


class TestFullyShardPartialBackwardExit(_LifecycleTestMixin, GlooMultiProcessTestCase):
    """
    ``partial_backward(outer_backward=True)`` exit finishes the groups that the
    decoder backward does not reach (a separately sharded head) per the
    caller's policy: a reducing microbatch issues the head's reduce-scatter on
    exit, before the first decoder block's backward, and every microbatch
    reshards the head (``reshard_after_backward=True``), so the head holds no
    unsharded parameter storage during the decoder backward; a no-sync
    microbatch keeps its unsharded gradient. A grouped ``[norm, lm_head]`` head
    is reduced when the decoder backward reaches ``norm``, as before, which is
    also before the first block. Two optimizer steps match the reference, with
    exactly one reduction per group per reducing microbatch. Revision 2 issued
    a separate head's reduce-scatter last, in the root's final callback, and
    kept its unsharded weight through the decoder backward.
    """

    @property
    def world_size(self) -> int:
        return 2

    @parametrize("deferral", ["on", "off"])
    @parametrize("layout", ["separate", "grouped"])
    def test_head_finished_before_decoder_backward(self, layout: str, deferral: str):
        mesh = self._mesh()
        model, ref = _make_models(layout, "full", norm_in_forward=True, mesh=mesh)
        head = _head_group(model)
        events: list[tuple[str, str]] = []
        head_storage_during_decoder_backward: list[int] = []

        def record_layer_backward(name: str):
            def hook(grad: torch.Tensor) -> None:
                events.append(("backward", name))
                head_storage_during_decoder_backward.append(
                    sum(
                        p.untyped_storage().size()
                        for p in model.lm_head.unsharded_parameters()
                    )
                )

            return hook

        def register(name: str):
            def forward_hook(module, args, out) -> None:
                if out.requires_grad:
                    out.register_hook(record_layer_backward(name))

            return forward_hook

        for i, layer in enumerate(model.layers):
            layer.register_forward_hook(register(f"layers.{i}"))
        recorder = _Recorder(model)
        orig_reduce = _fsdp_param_group.foreach_reduce

        def reduce(fsdp_params, *args, **kwargs):
            group = recorder._group_of[id(fsdp_params[0])]
            events.append(("reduce", param_group_name(group)))
            return orig_reduce(fsdp_params, *args, **kwargs)

        optim = torch.optim.SGD(model.parameters(), lr=LR)
        ref_optim = torch.optim.SGD(ref.parameters(), lr=LR)
        num_steps = 2
        for step in range(num_steps):
            tokens, labels = random_token_microbatches(
                1000 * step + self.rank,
                NUM_MICROBATCHES,
                VOCAB_SIZE,
                BATCH_SIZE,
                SEQ_LEN,
            )
            for mb in range(NUM_MICROBATCHES):
                where = f"step {step}, microbatch {mb}"
                reducing = deferral == "off" or mb == NUM_MICROBATCHES - 1
                events.clear()
                head_storage_during_decoder_backward.clear()
                _fsdp_param_group.foreach_reduce = reduce
                try:
                    with recorder.record(), _microbatch_policy(model, deferral, mb):
                        _chunked_loss_step(model, tokens[mb], labels[mb])
                finally:
                    _fsdp_param_group.foreach_reduce = orig_reduce
                head_name = param_group_name(head)  # FQNs are set at lazy init
                first_block = events.index(("backward", "layers.1"))
                if reducing:
                    self.assertIn(("reduce", head_name), events[:first_block], where)
                    self.assertEqual(events.count(("reduce", head_name)), 1, where)
                else:
                    self.assertNotIn(("reduce", head_name), events, where)
                    self.assertTrue(
                        model.lm_head.has_pending_gradients(recurse=False), where
                    )
                self.assertEqual(
                    head_storage_during_decoder_backward,
                    [0] * len(model.layers),
                    where,
                )
            self._reference_step(ref, tokens, labels)
            self._assert_matches_reference(model, ref, "grad")
            optim.step()
            ref_optim.step()
            optim.zero_grad()
            ref_optim.zero_grad()
            self._assert_matches_reference(model, ref, "param")
        num_reducing = NUM_MICROBATCHES if deferral == "off" else 1
        for group in fsdp_param_groups(model):
            self.assertEqual(
                recorder.reduce_scatters[group],
                num_steps * num_reducing,
                param_group_name(group),
            )


instantiate_parametrized_tests(TestFullyShardPartialBackwardExit)


if __name__ == "__main__":
    run_tests()
