# Owner(s): ["oncall: distributed"]
"""
Tests for the exit of ``FSDPModule.partial_backward(outer_backward=True)``:
the groups the decoder backward does not reach are reduced and resharded per
the caller's policy before the first decoder block's backward, observed with
``FSDPModule.unsharded_parameters`` and ``FSDPModule.has_pending_gradients``.

The models and the test mixin are those of test_fully_shard_lifecycle.py.
Every multi-process test runs gloo on CPU through ``GlooMultiProcessTestCase``.
"""

import copy
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
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
    _chunked_loss_step,
    _head_group,
    _LifecycleTestMixin,
    _loss,
    _make_models,
    _microbatch_policy,
    _Recorder,
    _unsharded_bytes,
    BATCH_SIZE,
    HEAD_LAYOUTS,
    LR,
    NUM_CHUNKS,
    NUM_MICROBATCHES,
    SEQ_LEN,
    Transformer,
    VOCAB_SIZE,
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


# Programs of :class:`TestFullyShardPartialBackwardReach`: the non-chunked
# program, and the chunked one with the scope on ``lm_head`` or on the root
PROGRAMS = ("full", "lm_head", "root")


def _make_rootless_models(layout: str, mesh) -> tuple[Transformer, Transformer]:
    """
    Returns ``(model, ref)`` for ``layout``, with every top-level module
    sharded on its own or in the head group, so that the root's group holds no
    parameters (a root group stays gathered after a forward without backward,
    with or without a scope), and a float64 copy.
    """
    torch.manual_seed(42)
    model = Transformer(norm_in_forward=True)
    if layout == "tied":
        model.lm_head.weight = model.tok_embeddings.weight
    ref = copy.deepcopy(model).double()
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    head_names = HEAD_LAYOUTS[layout]
    head_modules = [model.get_submodule(n) for n in head_names]
    fully_shard(head_modules if len(head_modules) > 1 else head_modules[0], mesh=mesh)
    for name in ("tok_embeddings", "norm"):
        if name not in head_names:
            fully_shard(model.get_submodule(name), mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, ref


def _head_call(model: Transformer, h: torch.Tensor) -> torch.Tensor:
    return model.lm_head.finish_forward(model.lm_head(h))


def _microbatch(
    model: Transformer,
    program: str,
    tokens: torch.Tensor,
    labels: torch.Tensor,
    *,
    skip_backward: bool = False,
    metric_call: bool = False,
) -> None:
    """
    One microbatch of ``program``. ``skip_backward`` computes the losses and
    runs no backward (a guard that drops the microbatch); ``metric_call``
    first calls the head once with grad enabled on the last position and
    detaches the result.
    """
    h = model(tokens)
    if metric_call:
        _head_call(model, h[:, -1:]).detach()
    if program == "full":
        loss = _loss(_head_call(model, h), labels)
        if not skip_backward:
            loss.backward()
        return
    h_chunks = [c.detach().requires_grad_() for c in h.chunk(NUM_CHUNKS, dim=1)]
    scope_module = model if program == "root" else model.lm_head
    with scope_module.partial_backward():
        for h_chunk, label_chunk in zip(h_chunks, labels.chunk(NUM_CHUNKS, dim=1)):
            loss = _loss(_head_call(model, h_chunk), label_chunk)
            if skip_backward:
                break
            loss.backward()
    if not skip_backward:
        h.backward(torch.cat([c.grad for c in h_chunks], dim=1))


def _eval_microbatch(
    model: Transformer, program: str, tokens: torch.Tensor, outer_backward: bool
) -> None:
    """A ``torch.no_grad()`` evaluation of ``program``'s head calls."""
    with torch.no_grad():
        h = model(tokens)
        if program == "full":
            _head_call(model, h)
            return
        scope_module = model if program == "root" else model.lm_head
        with scope_module.partial_backward(outer_backward=outer_backward):
            for h_chunk in h.chunk(NUM_CHUNKS, dim=1):
                _head_call(model, h_chunk)


def _held_bytes(model: Transformer) -> int:
    """Unsharded parameter and gradient bytes that every group holds."""
    return sum(sum(_unsharded_bytes(g)) for g in fsdp_param_groups(model))


class _PartialBackwardReachMixin:
    """World size, mesh and float64 reference of the reach tests."""

    @property
    def world_size(self) -> int:
        return 2

    def _mesh(self):
        return init_device_mesh("cpu", (self.world_size,))

    def _reference_step(
        self, ref: Transformer, tokens: list[torch.Tensor], labels: list[torch.Tensor]
    ) -> None:
        """Every rank's ``tokens`` through the float64 ``ref``, full logits."""
        all_tokens: list[Any] = [None] * self.world_size
        all_labels: list[Any] = [None] * self.world_size
        dist.all_gather_object(all_tokens, tokens)
        dist.all_gather_object(all_labels, labels)
        for rank_tokens, rank_labels in zip(all_tokens, all_labels):
            for mb_tokens, mb_labels in zip(rank_tokens, rank_labels):
                loss = _loss(ref.lm_head(ref(mb_tokens)), mb_labels)
                (loss / self.world_size).backward()

    def _assert_close_to_reference(
        self, model: Transformer, ref: Transformer, what: str, where: str
    ) -> None:
        for (name, param), ref_param in zip(
            model.named_parameters(), ref.parameters(), strict=True
        ):
            actual = param.grad if what == "grad" else param
            expected = ref_param.grad if what == "grad" else ref_param
            self.assertIsNotNone(actual, f"{where}: {what} of {name}")
            torch.testing.assert_close(
                actual.full_tensor().double(),
                expected.detach(),
                atol=1e-5,
                rtol=1e-5,
                msg=lambda m, name=name: f"{where}: {what} of {name}: {m}",
            )


class TestFullyShardPartialBackwardReach(
    _PartialBackwardReachMixin, GlooMultiProcessTestCase
):
    """
    A ``partial_backward()`` exit leaves every group as the non-chunked
    program does, for separate, grouped and tied heads, with the scope on
    ``lm_head`` and on the root, against the non-chunked program on the same
    torch and a float64 single-process reference over several optimizer
    steps: a microbatch whose chunk losses are computed but whose backwards
    are all skipped (a loss guard), and a ``torch.no_grad()`` evaluation chunk
    loop, leave nothing gathered at ``optimizer.step()`` or after the
    evaluation. Revision 4 left the head gathered (2048 B): the next step's
    head forward skipped its all-gather and used the pre-step weights
    (gradient error 5.7e-03). The same holds under manual backward
    finalization, also for an evaluation whose scope has
    ``outer_backward=False`` (which left the head gathered and pending).
    """

    @parametrize("layout", list(HEAD_LAYOUTS))
    def test_scope_without_backward(self, layout: str):
        mesh = self._mesh()
        # (program, whether the root uses manual backward finalization)
        runs = [(p, manual) for p in PROGRAMS for manual in (False, True)]
        models, ref = {}, None
        for run in runs:
            models[run], ref = _make_rootless_models(layout, mesh)
            models[run].set_manual_backward_finalization(run[1])
        optims = {r: torch.optim.SGD(m.parameters(), lr=LR) for r, m in models.items()}
        ref_optim = torch.optim.SGD(ref.parameters(), lr=LR)
        num_steps = 3
        for step in range(num_steps):
            tokens, labels = random_token_microbatches(
                100 * step + self.rank, 3, VOCAB_SIZE, BATCH_SIZE, SEQ_LEN
            )
            held: dict[tuple[str, bool], list[int]] = {}
            for (program, manual), model in models.items():
                # Microbatch 0 trains; microbatch 1 is dropped before any
                # backward (reducing, as the last microbatch of the step)
                _microbatch(model, program, tokens[0], labels[0])
                _microbatch(model, program, tokens[1], labels[1], skip_backward=True)
                if manual:
                    model.finalize_backward()
                held[program, manual] = [_held_bytes(model)]
                # An evaluation chunk loop before optimizer.step(), its scope
                # ending the backward itself (no outer backward follows)
                _eval_microbatch(model, program, tokens[2], outer_backward=False)
                held[program, manual].append(_held_bytes(model))
            self._reference_step(ref, tokens[:1], labels[:1])
            for run, model in models.items():
                where = f"step {step}, {run}"
                # Nothing gathered at optimizer.step() (the first revision 5
                # left the head gathered under manual finalization after the
                # evaluation whose scope ends the backward)
                self.assertEqual(held[run], [0, 0], f"{where}: unsharded bytes")
                self._assert_close_to_reference(model, ref, "grad", where)
                optims[run].step()
                optims[run].zero_grad()
                # An evaluation chunk loop between optimizer steps
                _eval_microbatch(model, run[0], tokens[2], outer_backward=True)
                held[run].append(_held_bytes(model))
            ref_optim.step()
            ref_optim.zero_grad()
            for (program, manual), model in models.items():
                where = f"step {step}, {program}, manual={manual}"
                self._assert_close_to_reference(model, ref, "param", where)
                self.assertFalse(model.has_pending_gradients(), where)
                # At optimizer.step and after evaluation, as without chunking
                self.assertEqual(held[program, manual], held["full", manual], where)
                self.assertEqual(held["full", manual], [0, 0, 0], where)


instantiate_parametrized_tests(TestFullyShardPartialBackwardReach)


if __name__ == "__main__":
    run_tests()
