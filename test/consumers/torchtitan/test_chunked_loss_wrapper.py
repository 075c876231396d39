# Owner(s): ["oncall: distributed"]
"""
torchtitan's ``ChunkedLossWrapper``, from the installed torchtitan with the
consumer series (``consumers/torchtitan/``) applied, on FSDP2 with the
lifecycle APIs: the matrix torchtitan's reviewers asked for.

- FSDP (world 2) and HSDP 2x2 (world 4); separate, grouped ``[norm, lm_head]``
  and tied ``[tok_embeddings, norm, lm_head]`` heads; trainable and frozen
  decoders; gradient accumulation with sync on the last microbatch and on
  every microbatch; a caller policy that is not the default; evaluation
  (``torch.no_grad()``) between steps; an exception inside the chunk loop,
  the documented recovery (``reset_iter_state()``) and a retry.
- PP2 x FSDP2 (world 4) with GPipe, 1F1B and Interleaved1F1B, the wrapper as
  the last stage's ``loss_fn``, ``finalize_gradients=False`` then ``True``.

Each runs several optimizer steps like a training loop and checks losses,
gradients and parameters against a single-process full-logits reference, one
reduce-scatter per FSDP group per reducing microbatch or finalized step (zero
otherwise), and the caller's ``get_fsdp_policy()`` on every FSDP module
unchanged across every step. The retry is bitwise equal to a clean run.
"""

import contextlib
import copy
import inspect
import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, FSDPPolicy, fully_shard
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)
from torch.testing._internal.common_utils import run_tests

from torchtitan.components.loss import ChunkedLossWrapper, GradAccumulator


_TEST_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(_TEST_ROOT, "distributed"))
from fsdp_lifecycle_testing import (  # noqa: E402
    CollectiveCounter,
    GlooMultiProcessTestCase,
    fsdp_policies,
)


VOCAB, DIM, SEQ = 32, 16, 8
NUM_LAYERS = 2
NUM_CHUNKS = 4
MICROBATCH_SIZE = 2
NUM_MICROBATCHES = 2
NUM_STEPS = 3
LR = 0.5
TOL = {"atol": 1e-5, "rtol": 1e-5}
# (head, frozen decoder). A tied lm_head is the embedding: there is no decoder
# to freeze without freezing the head.
LAYOUTS = [
    ("separate", False),
    ("separate", True),
    ("grouped", False),
    ("grouped", True),
    ("tied", False),
]

class _InjectedError(Exception):
    pass


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x))


class Decoder(nn.Module):
    """
    torchtitan's ``Decoder`` shape: with ``_skip_lm_head`` the forward ends
    after ``norm`` and the loss runs ``lm_head``.
    """

    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleDict({str(i): Block() for i in range(NUM_LAYERS)})
        self.norm = nn.LayerNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
        if tied:
            self.lm_head.weight = self.tok_embeddings.weight
        self._skip_lm_head = False

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h)
        h = self.norm(h)
        if self._skip_lm_head:
            return h
        return self.lm_head(h)


# torchtitan main since "fold batch dim" (#4121; consumers/torchtitan/main-<sha>/)
# takes hidden states [T, D] and labels [T], chunked along dim 0; the 0.3.0
# release takes [B, L, D] and [B, L]. With main's sources first on PYTHONPATH
# this file tests main's patched wrapper on the same [B, L] batches, folded.
FOLDED = inspect.signature(GradAccumulator).parameters["seq_dim"].default == 0


class FoldedChunkedLossWrapper(ChunkedLossWrapper):
    """Main's wrapper on this file's ``[B, L, D]`` hidden states: folds them
    (and the labels) into tokens as torchtitan main's models do."""

    def __call__(self, pred, labels, global_valid_tokens=None, **loss_inputs):
        return super().__call__(
            pred.flatten(0, 1), labels.flatten(0, 1), global_valid_tokens, **loss_inputs
        )


def make_wrapper(lm_head: nn.Module) -> ChunkedLossWrapper:
    cls = FoldedChunkedLossWrapper if FOLDED else ChunkedLossWrapper
    wrapper = cls(ChunkedLossWrapper.Config(num_chunks=NUM_CHUNKS))
    wrapper.set_lm_head(lm_head)
    return wrapper


def fsdp_modules(*modules: nn.Module) -> list[FSDPModule]:
    return [m for root in modules for m in root.modules() if isinstance(m, FSDPModule)]


def groups_with_grads(groups: list[list[str]], ref_model: nn.Module) -> int:
    """How many of the ``fully_shard`` calls' parameter sets get a gradient."""
    grads = {n for n, p in ref_model.named_parameters() if p.grad is not None}
    return sum(1 for names in groups if grads & set(names))


def batch(step: int, num_microbatches: int, dp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: ``(dp * num_microbatches * MICROBATCH_SIZE, SEQ)``."""
    gen = torch.Generator().manual_seed(1000 + step)
    size = (dp * num_microbatches * MICROBATCH_SIZE, SEQ)
    return (
        torch.randint(0, VOCAB, size, generator=gen),
        torch.randint(0, VOCAB, size, generator=gen),
    )


def assert_params_equal(test, params: dict, ref_model: nn.Module, grads: bool) -> None:
    ref = dict(ref_model.named_parameters())
    for name, param in params.items():
        if grads:
            if ref[name].grad is None:
                test.assertIsNone(param.grad, name)
                continue
            test.assertIsNotNone(param.grad, name)
            test.assertEqual(param.grad.full_tensor(), ref[name].grad, **TOL, msg=name)
        else:
            test.assertEqual(param.full_tensor(), ref[name], **TOL, msg=name)


@dataclass
class Build:
    model: Decoder
    ref_model: Decoder
    wrapper: ChunkedLossWrapper
    groups: list[list[str]]
    optim: torch.optim.Optimizer
    ref_optim: torch.optim.Optimizer


def build(
    mesh: DeviceMesh, head: str, frozen_decoder: bool, policy: FSDPPolicy | None
) -> Build:
    torch.manual_seed(0)
    ref_model = Decoder(tied=head == "tied")
    if frozen_decoder:
        # Only lm_head trains: norm runs in the decoder forward, before the
        # detached hidden states
        for name, param in ref_model.named_parameters():
            param.requires_grad_(name.startswith("lm_head."))
    model = copy.deepcopy(ref_model)
    model._skip_lm_head = True
    groups = [[f"layers.{i}.lin.weight", f"layers.{i}.lin.bias"] for i in range(NUM_LAYERS)]
    for layer in model.layers.values():
        fully_shard(layer, mesh=mesh)
    if head == "separate":
        fully_shard(model.lm_head, mesh=mesh)
        groups.append(["lm_head.weight"])
        groups.append(["tok_embeddings.weight", "norm.weight", "norm.bias"])
    elif head == "grouped":
        fully_shard([model.norm, model.lm_head], mesh=mesh)
        groups.append(["norm.weight", "norm.bias", "lm_head.weight"])
        groups.append(["tok_embeddings.weight"])
    else:
        fully_shard([model.tok_embeddings, model.norm, model.lm_head], mesh=mesh)
        groups.append(["tok_embeddings.weight", "norm.weight", "norm.bias"])
    fully_shard(model, mesh=mesh)
    if policy is not None:
        model.set_fsdp_policy(policy, recurse=True)
    trainable = lambda m: [p for p in m.parameters() if p.requires_grad]  # noqa: E731
    return Build(
        model,
        ref_model,
        make_wrapper(model.lm_head),
        groups,
        torch.optim.SGD(trainable(model), lr=LR),
        torch.optim.SGD(trainable(ref_model), lr=LR),
    )


class ChunkedLossTestMixin:
    """The data-parallel training loop and its checks (FSDP and HSDP)."""

    def _dp_mesh(self) -> DeviceMesh:
        raise NotImplementedError

    replicas = 0  # HSDP: 1 (one replica all-reduce per reduce-scatter)
    all_reduces: list[int] = []

    def _dp_rank_and_size(self) -> tuple[int, int]:
        return self.rank, self.world_size

    def _train_step(
        self,
        b: Build,
        step: int,
        *,
        sync: str,
        counter: CollectiveCounter,
        fail_at: tuple[int, int] | None = None,
    ) -> tuple[torch.Tensor, list[int]]:
        """
        One optimizer step's microbatches (without the optimizer step);
        returns this rank's loss and the reduce-scatters of each microbatch.
        ``fail_at=(microbatch, chunk)`` raises inside the chunk loop.
        """
        dp_rank, dp = self._dp_rank_and_size()
        tokens, labels = batch(step, NUM_MICROBATCHES, dp)
        local = MICROBATCH_SIZE * NUM_MICROBATCHES
        tokens = tokens[dp_rank * local : (dp_rank + 1) * local]
        labels = labels[dp_rank * local : (dp_rank + 1) * local]
        # The loss of a rank is its mean over all its microbatches' tokens
        global_valid_tokens = torch.tensor(labels.numel())
        total = torch.zeros(())
        rs_per_microbatch = []
        inner = b.wrapper.loss_fn
        for mb in range(NUM_MICROBATCHES):
            is_last = mb == NUM_MICROBATCHES - 1
            mb_slice = slice(mb * MICROBATCH_SIZE, (mb + 1) * MICROBATCH_SIZE)
            if sync == "last":
                scope = b.model.fsdp_policy(
                    requires_gradient_sync=is_last,
                    is_last_backward=is_last,
                    recurse=True,
                )
            else:
                scope = contextlib.nullcontext()
            calls = [0]

            def failing_loss_fn(*args, **kwargs):
                if fail_at == (mb, calls[0]):
                    raise _InjectedError
                calls[0] += 1
                return inner(*args, **kwargs)

            b.wrapper.loss_fn = failing_loss_fn if fail_at is not None else inner
            counter.reset()
            try:
                with scope, counter.count():
                    pred = b.model(tokens[mb_slice])
                    loss, _ = b.wrapper(pred, labels[mb_slice], global_valid_tokens)
                    # With a frozen decoder the wrapper already ran every backward
                    if loss.requires_grad:
                        loss.backward()
            finally:
                b.wrapper.loss_fn = inner
            rs_per_microbatch.append(counter["reduce_scatter"])
            self.all_reduces.append(counter["all_reduce"])
            total += loss.detach()
        return total, rs_per_microbatch

    def _ref_step(self, b: Build, step: int) -> torch.Tensor:
        _, dp = self._dp_rank_and_size()
        tokens, labels = batch(step, NUM_MICROBATCHES, dp)
        loss = F.cross_entropy(b.ref_model(tokens).flatten(0, 1), labels.flatten())
        loss.backward()
        return loss.detach()

    def _dp_mean(self, loss: torch.Tensor) -> torch.Tensor:
        loss = loss.clone()
        dist.all_reduce(loss)
        return loss / dist.get_world_size()

    def _run_training(
        self,
        head: str,
        frozen_decoder: bool = False,
        sync: str = "last",
        policy: FSDPPolicy | None = None,
        evaluate: bool = False,
    ) -> None:
        b = build(self._dp_mesh(), head, frozen_decoder, policy)
        params = dict(b.model.named_parameters())
        modules = fsdp_modules(b.model)
        policies = fsdp_policies(b.model)
        if policy is not None:
            self.assertEqual(set(policies.values()), {policy})
        counter = CollectiveCounter()
        for step in range(NUM_STEPS):
            self.all_reduces = []
            loss, rs = self._train_step(b, step, sync=sync, counter=counter)
            # HSDP all-reduces each reduce-scatter's output across replicas
            self.assertEqual(self.all_reduces, [n * self.replicas for n in rs])
            ref_loss = self._ref_step(b, step)
            self.assertEqual(fsdp_policies(b.model), policies, msg=f"step {step}")
            self.assertEqual(self._dp_mean(loss), ref_loss, **TOL)
            num_groups = groups_with_grads(b.groups, b.ref_model)
            expected = [
                num_groups if sync == "every" or mb == NUM_MICROBATCHES - 1 else 0
                for mb in range(NUM_MICROBATCHES)
            ]
            self.assertEqual(rs, expected, msg=f"step {step}")
            self.assertGreater(num_groups, 0)
            for m in modules:
                self.assertFalse(m.has_pending_gradients())
            assert_params_equal(self, params, b.ref_model, grads=True)
            b.optim.step()
            b.ref_optim.step()
            b.optim.zero_grad(set_to_none=True)
            b.ref_optim.zero_grad(set_to_none=True)
            assert_params_equal(self, params, b.ref_model, grads=False)
            if evaluate:
                self._evaluate(b, step, counter)
                self.assertEqual(fsdp_policies(b.model), policies)

    def _evaluate(self, b: Build, step: int, counter: CollectiveCounter) -> None:
        """Validation as torchtitan runs it: ``torch.no_grad()``, no backward."""
        dp_rank, dp = self._dp_rank_and_size()
        tokens, labels = batch(100 + step, 1, dp)
        local = slice(dp_rank * MICROBATCH_SIZE, (dp_rank + 1) * MICROBATCH_SIZE)
        counter.reset()
        with torch.no_grad(), counter.count():
            loss, _ = b.wrapper(
                b.model(tokens[local]), labels[local], torch.tensor(labels[local].numel())
            )
            ref_loss = F.cross_entropy(
                b.ref_model(tokens).flatten(0, 1), labels.flatten()
            )
        self.assertFalse(loss.requires_grad)
        self.assertEqual(self._dp_mean(loss), ref_loss, **TOL)
        self.assertEqual(counter["reduce_scatter"], 0)
        for m in fsdp_modules(b.model):
            self.assertFalse(m.has_pending_gradients())
        for name, param in b.model.named_parameters():
            self.assertIsNone(param.grad, name)

    def _run_exception_and_retry(self, head: str, failed_microbatch: int) -> None:
        policy = FSDPPolicy(reshard_after_forward=False)
        clean = build(self._dp_mesh(), head, False, policy)
        b = build(self._dp_mesh(), head, False, policy)
        policies = fsdp_policies(b.model)
        counter = CollectiveCounter()
        for run in (clean, b):
            self._train_step(run, 0, sync="last", counter=counter)
            run.optim.step()
            run.optim.zero_grad(set_to_none=True)
        retry_losses = []
        with self.assertRaises(_InjectedError):
            self._train_step(
                b, 1, sync="last", counter=counter, fail_at=(failed_microbatch, 1)
            )
        self.assertEqual(fsdp_policies(b.model), policies)
        # The documented recovery: discard the failed iteration, then retry
        b.model.reset_iter_state()
        b.model.zero_grad(set_to_none=True)
        for run in (clean, b):
            loss, rs = self._train_step(run, 1, sync="last", counter=counter)
            self.assertEqual(fsdp_policies(run.model), policies)
            retry_losses.append(loss)
        self.assertTrue(torch.equal(retry_losses[0], retry_losses[1]))
        for (name, p), q in zip(b.model.named_parameters(), clean.model.parameters()):
            self.assertTrue(torch.equal(p.grad.to_local(), q.grad.to_local()), name)
        for run in (clean, b):
            run.optim.step()
        for (name, p), q in zip(b.model.named_parameters(), clean.model.parameters()):
            self.assertTrue(torch.equal(p.to_local(), q.to_local()), name)
        for m in fsdp_modules(b.model):
            self.assertFalse(m.has_pending_gradients())


class TestChunkedLossWrapperFSDP(ChunkedLossTestMixin, GlooMultiProcessTestCase):
    """FSDP on world 2."""

    def _dp_mesh(self) -> DeviceMesh:
        return init_device_mesh("cpu", (self.world_size,))

    def test_training_matrix(self):
        """
        Heads x decoders x accumulation modes, the caller's default policy,
        with evaluation between the steps.
        """
        self.run_subtests(
            {
                "layout": LAYOUTS,
                "sync": ["last", "every"],
            },
            self._test_training_matrix,
        )

    def _test_training_matrix(self, layout: tuple[str, bool], sync: str) -> None:
        head, frozen_decoder = layout
        self._run_training(head, frozen_decoder, sync, evaluate=sync == "last")

    def test_caller_policy_not_default(self):
        """
        A caller policy that is not the default (no reshard after forward on
        every module) stays in force across every step: the wrapper never
        changes it.
        """
        self.run_subtests(
            {"layout": LAYOUTS},
            self._test_caller_policy,
        )

    def _test_caller_policy(self, layout: tuple[str, bool]) -> None:
        head, frozen_decoder = layout
        self._run_training(
            head, frozen_decoder, "last", policy=FSDPPolicy(reshard_after_forward=False)
        )

    def test_exception_in_chunk_loop_and_retry(self):
        """
        An exception inside the chunk loop leaves the caller's policy in
        force; after ``reset_iter_state()`` and ``zero_grad()`` a retry of
        the step is bitwise equal to a clean run.
        """
        self.run_subtests(
            {
                "head": ["separate", "grouped", "tied"],
                "failed_microbatch": [0, NUM_MICROBATCHES - 1],
            },
            self._run_exception_and_retry,
        )


class TestChunkedLossWrapperHSDP(ChunkedLossTestMixin, GlooMultiProcessTestCase):
    """HSDP 2x2 (replicate 2, shard 2) on world 4."""

    replicas = 1

    @property
    def world_size(self) -> int:
        return 4

    def _dp_mesh(self) -> DeviceMesh:
        return init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))

    def test_training_matrix(self):
        self.run_subtests(
            {
                "layout": LAYOUTS,
                "sync": ["last", "every"],
            },
            self._test_training_matrix,
        )

    def _test_training_matrix(self, layout: tuple[str, bool], sync: str) -> None:
        head, frozen_decoder = layout
        # HSDP's replica all-reduce follows the reduce-scatter, once per group
        self._run_training(
            head,
            frozen_decoder,
            sync,
            policy=FSDPPolicy(reshard_after_forward=False) if sync == "every" else None,
            evaluate=sync == "last",
        )

    def test_exception_in_chunk_loop_and_retry(self):
        self.run_subtests(
            {"head": ["grouped"], "failed_microbatch": [NUM_MICROBATCHES - 1]},
            self._run_exception_and_retry,
        )


# -- PP2 x FSDP2 ---------------------------------------------------------------------
PP_SCHEDULES = {
    "gpipe": (ScheduleGPipe, 2),
    "1f1b": (Schedule1F1B, 2),
    "interleaved_1f1b": (ScheduleInterleaved1F1B, 4),
}
PP_NUM_MICROBATCHES = 4
PP_NUM_LAYERS = 4


class StageModule(nn.Module):
    """A pipeline stage of :class:`PPDecoder`; the last one stops after ``norm``."""

    def __init__(self, model: "PPDecoder", layer_ids: list[int], first: bool, last: bool):
        super().__init__()
        self.tok_embeddings = model.tok_embeddings if first else None
        self.layers = nn.ModuleDict({str(i): model.layers[str(i)] for i in layer_ids})
        self.norm = model.norm if last else None
        self.lm_head = model.lm_head if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tok_embeddings is not None:
            x = self.tok_embeddings(x)
        for layer in self.layers.values():
            x = layer(x)
        if self.norm is not None:
            x = self.norm(x)
        return x


class PPDecoder(Decoder):
    def __init__(self) -> None:
        nn.Module.__init__(self)
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleDict({str(i): Block() for i in range(PP_NUM_LAYERS)})
        self.norm = nn.LayerNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
        self._skip_lm_head = False


class TestChunkedLossWrapperPipelining(GlooMultiProcessTestCase):
    """PP2 x FSDP2 on world 4: the wrapper is the last stage's ``loss_fn``."""

    @property
    def world_size(self) -> int:
        return 4

    def test_pipeline_schedules(self):
        """
        Per schedule and head: a finalized step (with metadata inference), an
        evaluation step under ``torch.no_grad()``, a
        ``finalize_gradients=False`` step, then a finalized one, each checked
        against the reference; one reduce-scatter per FSDP group per
        finalized step and none in the non-finalized one.
        """
        self.run_subtests(
            {
                "schedule_name": ["gpipe", "1f1b", "interleaved_1f1b"],
                "head": ["separate", "grouped"],
                "policy": [FSDPPolicy(), FSDPPolicy(reshard_after_forward=False)],
            },
            self._test_pipeline,
        )

    def _test_pipeline(self, schedule_name: str, head: str, policy: FSDPPolicy) -> None:
        schedule_cls, num_stages = PP_SCHEDULES[schedule_name]
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
        dp_mesh, pp_group = mesh["dp"], mesh["pp"].get_group()
        pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
        torch.manual_seed(0)
        ref_model = PPDecoder()
        model = copy.deepcopy(ref_model)
        stage_ids = [pp_rank, pp_rank + 2] if num_stages == 4 else [pp_rank]
        per_stage = PP_NUM_LAYERS // num_stages
        stage_mods, stages, groups = {}, [], 0
        for i in stage_ids:
            last = i == num_stages - 1
            mod = StageModule(
                model, list(range(i * per_stage, (i + 1) * per_stage)), i == 0, last
            )
            for layer in mod.layers.values():
                fully_shard(layer, mesh=dp_mesh)
                groups += 1
            if last:
                if head == "grouped":
                    fully_shard([mod.norm, mod.lm_head], mesh=dp_mesh)
                else:
                    fully_shard(mod.lm_head, mesh=dp_mesh)
                groups += 1
            fully_shard(mod, mesh=dp_mesh)
            # The stage root's own group: embeddings (first) or norm (separate head)
            groups += int(i == 0 or (last and head == "separate"))
            mod.set_fsdp_policy(policy, recurse=True)
            stage_mods[i] = mod
            stages.append(
                PipelineStage(mod, i, num_stages, torch.device("cpu"), group=pp_group)
            )
        last_id = num_stages - 1
        has_last = last_id in stage_mods
        local_batch = PP_NUM_MICROBATCHES * MICROBATCH_SIZE
        wrapper = make_wrapper(stage_mods[last_id].lm_head) if has_last else None

        def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            # torchtitan's pipeline loss: the wrapper's loss, mean over the
            # microbatch's tokens (the schedule scales by the microbatches)
            loss, _ = wrapper(output, target, torch.tensor(target.numel()))
            return loss

        schedule = schedule_cls(
            stages if len(stages) > 1 else stages[0],
            n_microbatches=PP_NUM_MICROBATCHES,
            loss_fn=loss_fn,
        )
        modules = fsdp_modules(*stage_mods.values())
        policies = [m.get_fsdp_policy() for m in modules]
        params = {n: p for mod in stage_mods.values() for n, p in mod.named_parameters()}
        optim = torch.optim.SGD(params.values(), lr=LR)
        ref_optim = torch.optim.SGD(ref_model.parameters(), lr=LR)
        counter = CollectiveCounter()
        counts, losses_by_step = [], []
        for step, finalize in enumerate((True, False, True)):
            gen = torch.Generator().manual_seed(2000 + step)
            tokens = torch.randint(0, VOCAB, (2 * local_batch, SEQ), generator=gen)
            labels = torch.randint(0, VOCAB, (2 * local_batch, SEQ), generator=gen)
            local = slice(dp_rank * local_batch, (dp_rank + 1) * local_batch)
            args = (tokens[local],) if 0 in stage_mods else ()
            kwargs = {"target": labels[local]} if has_last else {}
            losses: list[torch.Tensor] = []
            counter.reset()
            with counter.count():
                schedule.step(
                    *args, losses=losses, finalize_gradients=finalize, **kwargs
                )
            counts.append(counter["reduce_scatter"])
            ref_loss = F.cross_entropy(ref_model(tokens).flatten(0, 1), labels.flatten())
            ref_loss.backward()
            # The caller's policy is in force between any two steps,
            # finalized or not
            now = [m.get_fsdp_policy() for m in modules]
            self.assertEqual(now, policies, msg=f"step {step}")
            if has_last:
                loss = torch.stack([x.detach() for x in losses]).mean()
                dist.all_reduce(loss, group=dp_mesh.get_group())
                losses_by_step.append(loss / 2)
                if finalize:
                    # After a non-finalized step the loss covers one step
                    self.assertEqual(losses_by_step[-1], ref_loss, **TOL)
            if finalize:
                assert_params_equal(self, params, ref_model, grads=True)
                optim.step()
                ref_optim.step()
                optim.zero_grad(set_to_none=True)
                ref_optim.zero_grad(set_to_none=True)
                assert_params_equal(self, params, ref_model, grads=False)
                for m in modules:
                    self.assertFalse(m.has_pending_gradients())
            if step == 0:
                self._pp_evaluate(schedule, stage_mods, ref_model, dp_rank, dp_mesh, local_batch)
                self.assertEqual([m.get_fsdp_policy() for m in modules], policies)
        self.assertEqual(counts, [groups, 0, groups], msg=f"rank {self.rank}")

    def _pp_evaluate(self, schedule, stage_mods, ref_model, dp_rank, dp_mesh, local_batch):
        """A forward-only ``eval()`` step under ``torch.no_grad()`` (how
        chunked-loss users evaluate): the reference's loss, no gradients, no
        pending FSDP state."""
        gen = torch.Generator().manual_seed(3000)
        tokens = torch.randint(0, VOCAB, (2 * local_batch, SEQ), generator=gen)
        labels = torch.randint(0, VOCAB, (2 * local_batch, SEQ), generator=gen)
        local = slice(dp_rank * local_batch, (dp_rank + 1) * local_batch)
        args = (tokens[local],) if 0 in stage_mods else ()
        has_last = any(mod.lm_head is not None for mod in stage_mods.values())
        kwargs = {"target": labels[local]} if has_last else {}
        losses: list[torch.Tensor] = []
        with torch.no_grad():
            schedule.eval(*args, losses=losses, **kwargs)
            ref_loss = F.cross_entropy(ref_model(tokens).flatten(0, 1), labels.flatten())
        if has_last:
            loss = torch.stack(losses).mean()
            dist.all_reduce(loss, group=dp_mesh.get_group())
            self.assertEqual(loss / 2, ref_loss, **TOL)
        for mod in stage_mods.values():
            for name, param in mod.named_parameters():
                self.assertIsNone(param.grad, name)
            for m in fsdp_modules(mod):
                self.assertFalse(m.has_pending_gradients())


if __name__ == "__main__":
    run_tests()
