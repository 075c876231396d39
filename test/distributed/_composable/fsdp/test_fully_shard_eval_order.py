# Owner(s): ["oncall: distributed"]
"""
A forward-only iteration (a ``torch.no_grad()`` evaluation forward of the
root) leaves no post-forward order behind, so the next training backward
prefetches exactly as a training step that no evaluation preceded. On 2.15.0
the evaluation forward's entries stay in the order, and the next backward
issues one extra all-gather per stale entry it prefetches by.

Only 2.15.0's APIs are used, so the test runs unchanged on 2.15.0, where
``test_eval_loop_bounded`` fails: each evaluation forward leaves one entry per
group in the post-forward order (12 after three batches here).
"""

import collections
import copy
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard
from torch.testing._internal.common_utils import (
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
)
from torch.utils.checkpoint import checkpoint


sys.path.insert(
    0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
)
from fsdp_lifecycle_testing import (  # noqa: E402
    CollectiveCounter,
    fsdp_param_groups,
    GlooMultiProcessTestCase,
    param_group_name,
)

# The chunked-loss model and helpers of the partial_backward() tests
# (pytorch/pytorch#203176), whose evaluation loops this patch bounds. Their
# test classes are reached through the module only, so that they are not
# collected here too
# On a torch without the series (2.15.0) only ``TestFullyShardEvalOrder``
# exists, so that it shows 2.15.0's behaviour
try:
    import test_fully_shard_lifecycle as lifecycle
    from test_fully_shard_lifecycle import (
        _bookkeeping,
        _LifecycleTestMixin,
        _loss,
        _make_data,
        _make_models,
        _Recorder,
        ATOL,
        BATCH_SIZE,
        LR,
        NUM_CHUNKS,
        NUM_MICROBATCHES,
        RTOL,
        SEQ_LEN,
        VOCAB_SIZE,
    )
except ImportError:
    lifecycle = None


DIM = 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


class Model(nn.Module):
    def __init__(self, *, checkpointed: bool = False, head_in_forward: bool = True):
        super().__init__()
        self.embed = nn.Linear(DIM, DIM)
        self.body = nn.ModuleList([Block() for _ in range(2)])
        self.lm_head = nn.Linear(DIM, DIM)
        self.checkpointed = checkpointed
        # ``False``: the forward returns the hidden state and the caller runs
        # ``lm_head`` on it, after the root's forward
        self.head_in_forward = head_in_forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.body:
            if self.checkpointed and torch.is_grad_enabled():
                x = checkpoint(block, x, use_reentrant=True)
            else:
                x = block(x)
        return self.lm_head(x) if self.head_in_forward else x

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self(x) if self.head_in_forward else self.lm_head(self(x))


def _shard(model: Model) -> Model:
    for block in model.body:
        fully_shard(block)
    fully_shard(model.lm_head)
    fully_shard(model)
    return model


class TestFullyShardEvalOrder(GlooMultiProcessTestCase):
    @property
    def world_size(self) -> int:
        return 2

    def _backward_all_gathers(
        self, model: Model, inp: torch.Tensor, *, evaluate: bool
    ) -> int:
        if evaluate:
            with torch.no_grad():
                model(inp)
        loss = model(inp).square().mean()
        counter = CollectiveCounter()
        with counter.count():
            loss.backward()
        return counter["all_gather"]

    @parametrize("checkpointed", [False, True])
    def test_eval_forward_then_train_step(self, checkpointed: bool):
        """
        Two optimizer steps, each preceded by an evaluation forward: every
        step's backward all-gathers as often as one without the evaluation
        forward (3 here: the two blocks and the head are resharded after
        forward; with reentrant checkpointing the blocks' recomputed forwards
        are recorded as before), and the parameters match a model trained
        without evaluation forwards.
        """
        torch.manual_seed(0)
        model = Model(checkpointed=checkpointed)
        ref_model = copy.deepcopy(model)
        _shard(model)
        _shard(ref_model)
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        ref_optim = torch.optim.SGD(ref_model.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(self.rank)
        for step in range(2):
            inp = torch.randn(4, DIM, generator=gen)
            num_ref = self._backward_all_gathers(ref_model, inp, evaluate=False)
            num = self._backward_all_gathers(model, inp, evaluate=True)
            self.assertEqual(num, num_ref, f"step {step}")
            if not checkpointed:
                self.assertEqual(num_ref, 3, f"step {step}")
            for opt in (optim, ref_optim):
                opt.step()
                opt.zero_grad()
            for param, ref_param in zip(model.parameters(), ref_model.parameters()):
                self.assertEqual(param.full_tensor(), ref_param.full_tensor())
        dist.barrier()

    # The backward's all-gathers in each program of
    # ``test_backward_all_gathers_against_2_15_0`` on torch 2.15.0 without the
    # patch (measured by running this test there): the evaluation forward's
    # stale post-forward entries make the next backward prefetch by them and
    # all-gather the head once more
    ALL_GATHERS_2_15_0 = {"train": 3, "eval_then_train": 4, "eval_between": 4}

    def test_backward_all_gathers_against_2_15_0(self):
        """
        The backward after an evaluation forward (before the training forward,
        or between it and its backward) issues the all-gathers of a training
        step without evaluation (3), one fewer than 2.15.0
        (:attr:`ALL_GATHERS_2_15_0`), with bitwise equal gradients, over
        several SGD steps.
        """
        torch.manual_seed(0)
        base = Model(head_in_forward=False)
        models = {name: _shard(copy.deepcopy(base)) for name in self.ALL_GATHERS_2_15_0}
        optims = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models.values()]
        gen = torch.Generator().manual_seed(self.rank)
        for step in range(3):
            inp = torch.randn(4, DIM, generator=gen)
            counts, grads = {}, {}
            for name, model in models.items():
                if name == "eval_then_train":
                    with torch.no_grad():
                        model.logits(inp)
                loss = model.logits(inp).square().mean()
                if name == "eval_between":
                    with torch.no_grad():
                        model.logits(inp)
                counter = CollectiveCounter()
                with counter.count():
                    loss.backward()
                counts[name] = counter["all_gather"]
                grads[name] = [p.grad.full_tensor() for p in model.parameters()]
            self.assertEqual(
                counts,
                dict.fromkeys(self.ALL_GATHERS_2_15_0, 3),
                f"step {step}: {counts}",
            )
            for name in models:
                for grad, train_grad in zip(grads[name], grads["train"], strict=True):
                    self.assertTrue(torch.equal(grad, train_grad), name)
            for optim in optims:
                optim.step()
                optim.zero_grad()

    def test_eval_loop_bounded(self):
        """
        A loop of evaluation forwards leaves the post-forward order empty.
        """
        torch.manual_seed(0)
        model = _shard(Model())
        with torch.no_grad():
            for _ in range(3):
                model(torch.randn(4, DIM))
        self.assertEqual(len(model._get_fsdp_state()._comm_ctx.post_forward_order), 0)


if lifecycle is not None:

    class TestFullyShardEvalBookkeeping(_LifecycleTestMixin, GlooMultiProcessTestCase):
        """
        Evaluation loops of the chunked-loss model (per-chunk head calls completed
        with ``finish_forward``, activation checkpointing) leave FSDP's
        bookkeeping as it was.
        """

        @property
        def world_size(self) -> int:
            return 2

        _assert_idle = lifecycle.TestFullyShardPartialBackwardLifecycle._assert_idle
        EXPECTED_ORDER = lifecycle.TestFullyShardBookkeepingGradMode.EXPECTED_ORDER
        EXPECTED_PREFETCHES = (
            lifecycle.TestFullyShardBookkeepingGradMode.EXPECTED_PREFETCHES
        )
        _make_model = lifecycle.TestFullyShardBookkeepingGradMode._make_model
        _train_step = lifecycle.TestFullyShardBookkeepingGradMode._train_step

        def test_evaluation_leaves_groups_sharded(self):
            """
            ``no_grad`` chunk calls plus ``finish_forward`` leave every non-root
            group sharded with no pending bookkeeping, for 50 batches.
            """
            self.run_subtests(
                {
                    "layout": ["separate", "grouped", "tied"],
                    "norm_in_forward": [True, False],
                },
                self._test_evaluation_leaves_groups_sharded,
            )

        def _test_evaluation_leaves_groups_sharded(
            self, layout: str, norm_in_forward: bool
        ):
            mesh = self._mesh()
            model, ref = _make_models(
                layout, "full", norm_in_forward=norm_in_forward, mesh=mesh
            )
            root_groups = model._get_fsdp_state()._fsdp_param_groups
            gen = torch.Generator().manual_seed(self.rank)
            for batch in range(50):
                tokens = torch.randint(
                    0, VOCAB_SIZE, (BATCH_SIZE, SEQ_LEN), generator=gen
                )
                with torch.no_grad():
                    h = model(tokens)
                    logits = torch.cat(
                        [
                            model.lm_head.finish_forward(model.head(c))
                            for c in h.chunk(NUM_CHUNKS, dim=1)
                        ],
                        dim=1,
                    )
                    if batch == 0:
                        torch.testing.assert_close(
                            logits, ref.head(ref(tokens)), atol=ATOL, rtol=RTOL
                        )
                for group in fsdp_param_groups(model):
                    if group not in root_groups:
                        self.assertTrue(group.is_sharded, param_group_name(group))
                self._assert_idle(model)
                self.assertEqual(
                    _bookkeeping(model)["post_forward_indices"],
                    [0] * len(fsdp_param_groups(model)),
                )

        def test_no_grad_iterations_bounded(self):
            """
            200 ``no_grad`` evaluation iterations, after training and between a
            training forward and its backward, leave the post-forward order as it
            was, with and without checkpointing; the next backward prefetches as
            usual.
            """
            tokens, labels = _make_data(self.rank)
            for checkpointing in (None, "reentrant"):
                model = self._make_model(checkpointing)
                recorder = _Recorder(model)
                comm_ctx = model._get_fsdp_state()._comm_ctx
                with recorder.record():
                    self._train_step(model, tokens[0], labels[0], recorder)
                    with torch.no_grad():
                        for it in range(200):
                            model(tokens[it % NUM_MICROBATCHES])
                            self.assertEqual(len(comm_ctx.post_forward_order), 0)
                    self.assertEqual(
                        [
                            len(g._post_forward_indices)
                            for g in fsdp_param_groups(model)
                        ],
                        [0] * 3,
                    )
                    # An evaluation between a training forward and its backward
                    loss = _loss(model(tokens[1]), labels[1])
                    with torch.no_grad():
                        for it in range(200):
                            model(tokens[it % NUM_MICROBATCHES])
                    order = [param_group_name(g) for g in comm_ctx.post_forward_order]
                    self.assertEqual(order, self.EXPECTED_ORDER)
                    num_prefetches = len(recorder.prefetches)
                    recorder.record_prefetches = True
                    loss.backward()
                    recorder.record_prefetches = False
                    prefetches = [
                        (param_group_name(source), param_group_name(target))
                        for source, target in recorder.prefetches[num_prefetches:]
                    ]
                    self.assertEqual(prefetches, self.EXPECTED_PREFETCHES)
                    self.assertEqual(len(comm_ctx.post_forward_order), 0)

    class TestFullyShardEvalThenTrain(_LifecycleTestMixin, GlooMultiProcessTestCase):
        """
        2.15.0 user code without the new APIs: a grouped head
        (``fully_shard([norm, lm_head])``) called per chunk after the root forward,
        and a ``no_grad`` evaluation between training steps that calls the head
        the same way. The evaluation leaves the head's forward incomplete (its
        claim on the iteration stays), so the next training iteration starts
        without the root claiming it; that iteration must still record its
        post-forward order and prefetch in backward.
        """

        # Measured on torch 2.15.0 without the patches (world 1 and 2, this model
        # and step): the post-forward order after the forward, and the implicit
        # backward prefetches (source -> target). A training step right after the
        # evaluation completes the head group inside the root forward, so its own
        # entries are in another order. 2.15.0 also keeps the evaluation's four
        # entries in front of them and issues one more prefetch, from
        # ``layers.0`` to the evaluation's stale head entry; the patched FSDP
        # drops an evaluation's entries (see [Note: FSDP evaluation bookkeeping]),
        # so these are 2.15.0's entries and prefetches for the training iteration
        # itself. Revision 2 recorded ``["<root>"]`` and prefetched nothing.
        EXPECTED_ORDER = ["layers.0", "layers.1", "<root>", "norm, lm_head"]
        EXPECTED_PREFETCHES = [
            ("<root>", "layers.1"),
            ("norm, lm_head", "<root>"),
            ("layers.1", "layers.0"),
        ]
        # Reduce-scatters per group in one step, also as in 2.15.0: the grouped
        # head, called per chunk without ``finish_forward``, reduces twice
        EXPECTED_REDUCE_SCATTERS = {
            "<root>": 1,
            "layers.0": 1,
            "layers.1": 1,
            "norm, lm_head": 2,
        }
        EXPECTED_ORDER_AFTER_EVAL = ["layers.0", "layers.1", "norm, lm_head", "<root>"]
        EXPECTED_PREFETCHES_AFTER_EVAL = [
            ("norm, lm_head", "layers.1"),
            ("<root>", "norm, lm_head"),
            ("layers.1", "layers.0"),
        ]

        @property
        def world_size(self) -> int:
            return 2

        def test_eval_with_partial_head_calls_then_train(self):
            """
            Training steps with and without a preceding evaluation record 2.15.0's
            post-forward order and backward prefetches, reduce-scatter as 2.15.0
            does, and match an unsharded reference over several SGD steps.
            """
            tokens, labels = _make_data(self.rank)
            model, ref = _make_models(
                "grouped", "full", norm_in_forward=True, mesh=self._mesh()
            )
            optim = torch.optim.SGD(model.parameters(), lr=LR)
            ref_optim = torch.optim.SGD(ref.parameters(), lr=LR)
            comm_ctx = model._get_fsdp_state()._comm_ctx
            recorder = _Recorder(model)
            with recorder.record():
                for step in range(2 * NUM_MICROBATCHES):
                    eval_before = step % 2 == 1
                    mb = step % NUM_MICROBATCHES
                    where = f"step {step}, eval before: {eval_before}"
                    if eval_before:
                        with torch.no_grad():
                            h = model(tokens[mb])
                            for h_chunk in h.chunk(NUM_CHUNKS, dim=1):
                                model.lm_head(h_chunk)
                    num_prefetches = len(recorder.prefetches)
                    num_reduce_scatters = collections.Counter(recorder.reduce_scatters)
                    h = model(tokens[mb])
                    order = [param_group_name(g) for g in comm_ctx.post_forward_order]
                    loss = sum(
                        _loss(model.lm_head(h_chunk), label_chunk)
                        for h_chunk, label_chunk in zip(
                            h.chunk(NUM_CHUNKS, dim=1),
                            labels[mb].chunk(NUM_CHUNKS, dim=1),
                        )
                    )
                    recorder.record_prefetches = True
                    loss.backward()
                    recorder.record_prefetches = False
                    prefetches = [
                        (param_group_name(source), param_group_name(target))
                        for source, target in recorder.prefetches[num_prefetches:]
                    ]
                    if eval_before:
                        self.assertEqual(order, self.EXPECTED_ORDER_AFTER_EVAL, where)
                        self.assertEqual(
                            prefetches, self.EXPECTED_PREFETCHES_AFTER_EVAL, where
                        )
                    else:
                        self.assertEqual(order, self.EXPECTED_ORDER, where)
                        self.assertEqual(prefetches, self.EXPECTED_PREFETCHES, where)
                    self.assertEqual(
                        {
                            param_group_name(g): recorder.reduce_scatters[g]
                            - num_reduce_scatters[g]
                            for g in fsdp_param_groups(model)
                        },
                        self.EXPECTED_REDUCE_SCATTERS,
                        where,
                    )
                    self.assertEqual(len(comm_ctx.post_forward_order), 0, where)
                    self._reference_step(ref, [tokens[mb]], [labels[mb]])
                    self._assert_matches_reference(model, ref, "grad")
                    optim.step()
                    ref_optim.step()
                    optim.zero_grad()
                    ref_optim.zero_grad()
                    self._assert_matches_reference(model, ref, "param")


instantiate_parametrized_tests(TestFullyShardEvalOrder)


if __name__ == "__main__":
    run_tests()
