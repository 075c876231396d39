# Owner(s): ["oncall: distributed"]
"""
Pipelining with FSDP2 stages whose loss runs backward inside the forward action
(a chunked loss on the last stage written with ``partial_backward`` and
``finish_forward``): no-sync from the step entry, the caller's policy restored
after every step, one reduce-scatter per FSDP group per finalized step, and an
FSDP reset after metadata inference (pytorch/pytorch#203178).

World 4 = PP2 x FSDP2 (or PP2 x HSDP(1, 2)), gloo on CPU.
"""

import contextlib
import copy
import datetime
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, FSDPPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)
from torch.testing._internal.common_utils import run_tests


sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from fsdp_lifecycle_testing import (  # noqa: E402
    CollectiveCounter,
    GlooMultiProcessTestCase,
)


VOCAB, DIM, SEQ = 16, 8, 4
NUM_LAYERS = 4
NUM_MICROBATCHES = 4
MICROBATCH_SIZE = 2
DP = 2
LOCAL_BATCH = NUM_MICROBATCHES * MICROBATCH_SIZE
NUM_LOSS_CHUNKS = 2
LR = 0.1

SCHEDULES = {
    "gpipe": (ScheduleGPipe, 2),
    "1f1b": (Schedule1F1B, 2),
    "interleaved_1f1b": (ScheduleInterleaved1F1B, 4),
    "zbv": (ScheduleZBVZeroBubble, 4),
    "interleaved_zb": (ScheduleInterleavedZeroBubble, 4),
}


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x))


class TinyLM(nn.Module):
    """The single-process reference; stage modules reuse its parameter names."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleDict({str(i): Layer() for i in range(NUM_LAYERS)})
        self.norm = nn.LayerNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers.values():
            h = layer(h)
        return self.lm_head(self.norm(h))


class StageModule(nn.Module):
    """
    A pipeline stage of ``TinyLM``. The last stage holds ``norm`` and
    ``lm_head`` but its forward returns hidden states; the chunked loss runs the
    head. With ``norm_in_forward`` (the grouped ``[norm, lm_head]`` head) the
    forward also applies ``norm``, leaving the group forward partial.
    """

    def __init__(
        self, model: TinyLM, layer_ids: list[int], first: bool, last: bool, norm_in_forward: bool
    ) -> None:
        super().__init__()
        self.embed = model.embed if first else None
        self.layers = nn.ModuleDict({str(i): model.layers[str(i)] for i in layer_ids})
        self.norm = model.norm if last else None
        self.lm_head = model.lm_head if last else None
        self.norm_in_forward = norm_in_forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for layer in self.layers.values():
            x = layer(x)
        if self.norm is not None and self.norm_in_forward:
            x = self.norm(x)
        return x


def make_chunked_loss(
    stages_by_index: dict[int, StageModule], last: int, head: str, frozen_decoder: bool
):
    """
    A chunked cross-entropy that runs one head backward per sequence chunk
    inside the forward action, then returns a surrogate whose backward sends
    the accumulated hidden-state gradient into the decoder. With a frozen
    decoder nothing runs backward after the head, so the loss returns no
    surrogate and the head's partial backward has no outer backward.
    """

    def loss_fn(h: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        stage_mod = stages_by_index[last]
        lm_head = stage_mod.lm_head
        run_backward = torch.is_grad_enabled() and (frozen_decoder or h.requires_grad)
        h_detached = h.detach().requires_grad_(run_backward and not frozen_decoder)
        total = h.new_zeros(())
        ctx = (
            lm_head.partial_backward(outer_backward=not frozen_decoder)
            if run_backward
            else contextlib.nullcontext()
        )
        with ctx:
            for h_chunk, t_chunk in zip(
                h_detached.chunk(NUM_LOSS_CHUNKS, dim=1),
                target.chunk(NUM_LOSS_CHUNKS, dim=1),
            ):
                if head == "grouped":
                    logits = lm_head.finish_forward(lm_head(h_chunk))
                else:
                    logits = lm_head(stage_mod.norm(h_chunk))
                loss = (
                    F.cross_entropy(
                        logits.flatten(0, 1), t_chunk.flatten(), reduction="sum"
                    )
                    / target.numel()
                )
                if run_backward:
                    loss.backward()
                total = total + loss.detach()
        if not run_backward or frozen_decoder:
            return total
        surrogate = (h * h_detached.grad).sum()
        return surrogate - surrogate.detach() + total

    return loss_fn


class PipelineBuild:
    """One PP2 x DP2 pipeline with FSDP stages and its reference model."""

    def __init__(
        self,
        rank: int,
        schedule_name: str,
        head: str,
        hsdp: bool,
        policy: FSDPPolicy,
        frozen_decoder: bool = False,
    ) -> None:
        schedule_cls, num_stages = SCHEDULES[schedule_name]
        if hsdp:
            mesh = init_device_mesh(
                "cpu", (2, 1, DP), mesh_dim_names=("pp", "replicate", "shard")
            )
            dp_mesh = mesh["replicate", "shard"]
        else:
            mesh = init_device_mesh("cpu", (2, DP), mesh_dim_names=("pp", "dp"))
            dp_mesh = mesh["dp"]
        self.dp_group = (
            dp_mesh._flatten().get_group() if hsdp else dp_mesh.get_group()
        )
        pp_group = mesh["pp"].get_group()
        self.pp_rank = mesh["pp"].get_local_rank()
        self.dp_rank = rank % DP

        torch.manual_seed(0)
        self.ref_model = TinyLM()
        if frozen_decoder:
            # Only the head (norm and lm_head, both on the last stage) trains
            for module in (self.ref_model.embed, self.ref_model.layers):
                module.requires_grad_(False)
        model = copy.deepcopy(self.ref_model)
        self.ref_optim = torch.optim.SGD(self.ref_model.parameters(), lr=LR)

        if schedule_name == "zbv":
            stage_indices = [self.pp_rank, num_stages - 1 - self.pp_rank]
        elif num_stages == 4:
            stage_indices = [self.pp_rank, self.pp_rank + 2]
        else:
            stage_indices = [self.pp_rank]
        layers_per_stage = NUM_LAYERS // num_stages
        self.last_stage_index = num_stages - 1
        self.stage_mods: dict[int, StageModule] = {}
        stages = []
        # One reduce-scatter per FSDP parameter group with trainable
        # parameters (a grouped head is one group), counted as the groups
        # are built: a group manages the parameters of its modules that no
        # group built before it manages
        self.num_groups = 0
        managed: set[int] = set()

        def shard(modules: nn.Module | list[nn.Module]) -> None:
            fully_shard(modules, mesh=dp_mesh)
            own = [
                param
                for module in (modules if isinstance(modules, list) else [modules])
                for param in module.parameters()
                if id(param) not in managed
            ]
            managed.update(id(param) for param in own)
            self.num_groups += any(param.requires_grad for param in own)

        for stage_index in sorted(stage_indices):
            is_last = stage_index == num_stages - 1
            stage_mod = StageModule(
                model,
                list(
                    range(
                        stage_index * layers_per_stage,
                        (stage_index + 1) * layers_per_stage,
                    )
                ),
                first=stage_index == 0,
                last=is_last,
                norm_in_forward=is_last and head == "grouped",
            )
            for layer in stage_mod.layers.values():
                shard(layer)
            if is_last:
                if head == "grouped":
                    shard([stage_mod.norm, stage_mod.lm_head])
                else:
                    shard(stage_mod.lm_head)
            shard(stage_mod)
            stage_mod.set_fsdp_policy(policy, recurse=True)
            self.stage_mods[stage_index] = stage_mod
            stages.append(
                PipelineStage(
                    stage_mod, stage_index, num_stages, torch.device("cpu"), group=pp_group
                )
            )
        self.has_first = 0 in self.stage_mods
        self.has_last = self.last_stage_index in self.stage_mods
        # Sharded parameters by reference name, taken before any forward
        self.params = {
            name: param
            for stage_mod in self.stage_mods.values()
            for name, param in stage_mod.named_parameters()
        }
        self.optim = torch.optim.SGD(list(self.params.values()), lr=LR)
        self.fsdp_modules = [
            m
            for stage_mod in self.stage_mods.values()
            for m in stage_mod.modules()
            if isinstance(m, FSDPModule)
        ]
        loss_fn = make_chunked_loss(
            self.stage_mods, self.last_stage_index, head, frozen_decoder
        )
        if len(stages) == 1:
            self.schedule = schedule_cls(
                stages[0], n_microbatches=NUM_MICROBATCHES, loss_fn=loss_fn
            )
        else:
            self.schedule = schedule_cls(
                stages, n_microbatches=NUM_MICROBATCHES, loss_fn=loss_fn
            )
        self.stages = stages
        self.counter = CollectiveCounter()
        self.ref_losses: list[float] = []

    def policies(self) -> list[FSDPPolicy]:
        return [m.get_fsdp_policy() for m in self.fsdp_modules]

    @staticmethod
    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(100 + step)
        tokens = torch.randint(0, VOCAB, (DP * LOCAL_BATCH, SEQ), generator=gen)
        labels = torch.randint(0, VOCAB, (DP * LOCAL_BATCH, SEQ), generator=gen)
        return tokens, labels

    def schedule_inputs(self, step: int) -> tuple[tuple, dict]:
        """This rank's ``(args, kwargs)`` for the schedule at ``step``."""
        tokens, labels = self.batch(step)
        local = slice(self.dp_rank * LOCAL_BATCH, (self.dp_rank + 1) * LOCAL_BATCH)
        args = (tokens[local],) if self.has_first else ()
        kwargs = {"target": labels[local]} if self.has_last else {}
        return args, kwargs

    def step(self, step: int, *, finalize_gradients: bool = True) -> int:
        """Run one pipeline step and the reference; return reduce-scatters."""
        tokens, labels = self.batch(step)
        args, kwargs = self.schedule_inputs(step)
        losses: list[torch.Tensor] = []
        self.counter.reset()
        with self.counter.count():
            self.schedule.step(
                *args, losses=losses, finalize_gradients=finalize_gradients, **kwargs
            )
        num_reduce_scatters = self.counter["reduce_scatter"]
        ref_loss = F.cross_entropy(
            self.ref_model(tokens).flatten(0, 1), labels.flatten()
        )
        ref_loss.backward()
        self.last_losses = losses
        self.last_ref_loss = ref_loss.detach()
        return num_reduce_scatters

    def pp_loss(self) -> torch.Tensor:
        loss = torch.stack([last.detach() for last in self.last_losses]).mean()
        dist.all_reduce(loss, group=self.dp_group)
        return loss / DP

    def check_grads_and_update(self, test) -> None:
        """Compare gradients with the reference, step both optimizers, compare
        parameters and zero the gradients."""
        ref_params = dict(self.ref_model.named_parameters())
        for name, param in self.params.items():
            if not param.requires_grad:
                test.assertIsNone(param.grad, name)
                test.assertIsNone(ref_params[name].grad, name)
                continue
            test.assertIsNotNone(param.grad, name)
            test.assertEqual(
                param.grad.full_tensor(),
                ref_params[name].grad,
                atol=1e-5,
                rtol=1e-5,
                msg=name,
            )
        self.optim.step()
        self.ref_optim.step()
        for name, param in self.params.items():
            test.assertEqual(
                param.full_tensor(), ref_params[name], atol=1e-5, rtol=1e-5, msg=name
            )
        self.optim.zero_grad(set_to_none=True)
        self.ref_optim.zero_grad(set_to_none=True)


class PipelineFSDPTestBase(GlooMultiProcessTestCase):
    """World 4 (PP2 x DP2); checks the last stage's loss of a :class:`PipelineBuild`."""

    @property
    def world_size(self) -> int:
        return 4

    def _check_loss(self, build: PipelineBuild) -> None:
        if build.has_last:
            self.assertEqual(build.pp_loss(), build.last_ref_loss, atol=1e-5, rtol=1e-5)


class TestPipeliningFSDPLifecycle(PipelineFSDPTestBase):
    def test_parity_and_one_reduce_scatter_per_group(self):
        """
        Per schedule: losses, gradients and parameters after the optimizer step
        equal the reference; each finalized step (including the first, which
        runs metadata inference) reduce-scatters once per FSDP group; the
        caller's policy is back exactly after each finalized step; a
        non-finalized step followed by a finalized one accumulates.
        """
        self.run_subtests(
            {
                "schedule_name": [
                    "gpipe",
                    "1f1b",
                    "interleaved_1f1b",
                    "zbv",
                    "interleaved_zb",
                ],
                "head": ["separate", "grouped"],
                "hsdp": [False, True],
                "reshard_after_backward": [False, True],
            },
            self._test_parity,
        )

    def test_frozen_decoder(self):
        """
        With the decoder frozen, only the head trains and the chunked loss runs
        its head backwards with no outer backward: parity with the reference
        and one reduce-scatter per trainable FSDP group per finalized step.
        """
        self.run_subtests(
            {
                "schedule_name": ["gpipe", "interleaved_1f1b", "zbv"],
                "head": ["separate"],
                "hsdp": [False, True],
                "frozen_decoder": [True],
            },
            self._test_parity,
        )

    def _test_parity(
        self,
        schedule_name: str,
        head: str,
        hsdp: bool,
        frozen_decoder: bool = False,
        reshard_after_backward: bool = False,
    ) -> None:
        # reshard_after_backward=False is a caller policy that 2.15.0's
        # finalization overwrote; a finalized step must still reshard every
        # group after its reduction, or the step after optimizer.step() would
        # compute with the pre-optimizer unsharded parameters
        policy = FSDPPolicy(reshard_after_backward=reshard_after_backward)
        build = PipelineBuild(
            self.rank, schedule_name, head, hsdp, policy, frozen_decoder
        )
        counts = []
        # Step 0 runs metadata inference; step 1 is a steady-state step
        for step in range(2):
            counts.append(build.step(step))
            self.assertEqual(build.policies(), [policy] * len(build.fsdp_modules))
            self._check_loss(build)
            build.check_grads_and_update(self)
        # Accumulation: a non-finalized step then a finalized one
        counts.append(build.step(2, finalize_gradients=False))
        # The caller's policy is in force between any two steps
        self.assertEqual(build.policies(), [policy] * len(build.fsdp_modules))
        counts.append(build.step(3))
        self.assertEqual(build.policies(), [policy] * len(build.fsdp_modules))
        build.check_grads_and_update(self)
        expected = [build.num_groups, build.num_groups, 0, build.num_groups]
        self.assertEqual(counts, expected, msg=f"{schedule_name} rank {self.rank}")

class TestPipeliningFSDPDataParallelSteps(GlooMultiProcessTestCase):
    """
    One pipeline stage per rank and two data-parallel ranks: the smallest
    setting where a finalized step must leave every FSDP group resharded.
    """

    @property
    def world_size(self) -> int:
        return 2

    def test_finalized_step_reshards_for_next_forward(self):
        """
        With the caller's ``reshard_after_backward`` False or True, a finalized
        step reshards every group after its reduction and restores the policy:
        after ``optimizer.step()`` the next forward all-gathers the updated
        parameters. Forward outputs, losses and parameters equal a
        single-process reference after each of several steps, and each step
        reduce-scatters every group once.
        """
        self.run_subtests(
            {
                "schedule_cls": [ScheduleGPipe, Schedule1F1B],
                "reshard_after_backward": [False, True],
            },
            self._test_finalized_step_reshards,
        )

    def _test_finalized_step_reshards(
        self, schedule_cls: type, reshard_after_backward: bool
    ) -> None:
        torch.manual_seed(0)
        ref_model = nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh(), nn.Linear(DIM, DIM))
        model = copy.deepcopy(ref_model)
        mesh = init_device_mesh("cpu", (1, self.world_size), mesh_dim_names=("pp", "dp"))
        fully_shard(model[0], mesh=mesh["dp"])
        fully_shard(model[2], mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        model.set_reshard_after_backward(reshard_after_backward)
        policies = [m.get_fsdp_policy() for m in (model, model[0], model[2])]
        stage = PipelineStage(model, 0, 1, torch.device("cpu"), group=mesh["pp"].get_group())
        schedule = schedule_cls(stage, n_microbatches=2, loss_fn=nn.MSELoss())
        # The sharded parameters, taken before any forward
        params = dict(model.named_parameters())
        optim = torch.optim.SGD(params.values(), lr=LR)
        ref_optim = torch.optim.SGD(ref_model.parameters(), lr=LR)
        counter = CollectiveCounter()
        gen = torch.Generator().manual_seed(1)
        for step in range(3):
            x = torch.randn(2 * self.world_size * 2, DIM, generator=gen)
            y = torch.randn(2 * self.world_size * 2, DIM, generator=gen)
            local = x.chunk(self.world_size)[self.rank], y.chunk(self.world_size)[self.rank]
            losses: list[torch.Tensor] = []
            counter.reset()
            with counter.count():
                schedule.step(local[0], target=local[1], losses=losses)
            msg = f"step {step}"
            # One reduce-scatter per group (the two Linears; the root has no
            # parameters of its own)
            self.assertEqual(counter["reduce_scatter"], 2, msg=msg)
            self.assertEqual(
                [m.get_fsdp_policy() for m in (model, model[0], model[2])],
                policies,
                msg=msg,
            )
            ref_loss = nn.functional.mse_loss(ref_model(x), y)
            ref_loss.backward()
            loss = torch.stack(losses).mean().detach()
            dist.all_reduce(loss)
            self.assertEqual(loss / self.world_size, ref_loss, msg=msg)
            optim.step()
            ref_optim.step()
            optim.zero_grad(set_to_none=True)
            ref_optim.zero_grad(set_to_none=True)
            for (name, param), ref_param in zip(
                params.items(), ref_model.parameters()
            ):
                self.assertEqual(param.full_tensor(), ref_param, msg=f"{msg} {name}")
            # The next forward computes with the updated parameters
            with torch.no_grad():
                self.assertEqual(model(x), ref_model(x), msg=msg)


class Head(nn.Module):
    """A last-stage module whose ``lm_head`` only the loss function runs."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


class TestPipeliningFSDPMetadataInference(GlooMultiProcessTestCase):
    """
    Two stages on two ranks (PP2, FSDP on one rank each): what dynamic
    metadata inference leaves behind in FSDP, and its errors. The pipeline
    group has a short timeout, so a rank left waiting fails the test quickly
    instead of hanging.
    """

    @property
    def world_size(self) -> int:
        return 2

    def _build(self, ignored_head: bool = False, sharded_head_root: bool = True):
        torch.manual_seed(0)
        ref = nn.ModuleList([nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh()), Head()])
        stage_mod = copy.deepcopy(ref[self.rank])
        mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("pp", "dp"))
        pp_group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=20))
        if self.rank == 0:
            fully_shard(stage_mod[0], mesh=mesh["dp"])
            fully_shard(stage_mod, mesh=mesh["dp"])
        else:
            fully_shard(stage_mod.lin, mesh=mesh["dp"])
            if sharded_head_root:
                fully_shard(
                    stage_mod,
                    mesh=mesh["dp"],
                    ignored_params=set(stage_mod.lm_head.parameters())
                    if ignored_head
                    else None,
                )
            else:
                # A plain stage module whose children are sharded
                fully_shard(stage_mod.lm_head, mesh=mesh["dp"])
        stage = PipelineStage(stage_mod, self.rank, 2, torch.device("cpu"), group=pp_group)
        head = ref[1].lm_head if self.rank == 0 else stage_mod.lm_head

        def loss_fn(h: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            # Runs the head's backward itself, like a chunked loss
            h_detached = h.detach().requires_grad_(h.requires_grad)
            loss = F.cross_entropy(head(h_detached), target)
            if not torch.is_grad_enabled():
                return loss
            loss.backward()
            return (h * h_detached.grad).sum() - (h * h_detached.grad).sum().detach() + loss.detach()

        schedule = ScheduleGPipe(stage, n_microbatches=2, loss_fn=loss_fn)
        return ref, stage_mod, schedule

    def _inputs(self, step: int):
        gen = torch.Generator().manual_seed(step)
        x = torch.randn(4, DIM, generator=gen)
        y = torch.randint(0, VOCAB, (4,), generator=gen)
        return x, y

    def _step(self, schedule, step: int):
        x, y = self._inputs(step)
        if self.rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=y)

    def _ref_grads(self, ref: nn.Module, steps: list[int]) -> dict[str, torch.Tensor]:
        ref.zero_grad(set_to_none=True)
        for step in steps:
            x, y = self._inputs(step)
            F.cross_entropy(ref[1].lm_head(ref[1](ref[0](x))), y).backward()
        return {name: p.grad for name, p in ref[self.rank].named_parameters()}

    def test_probe_gradients_on_ignored_params_cleared(self):
        """
        A loss that runs the head's backward itself, with the head's
        parameters in ``ignored_params``: after the first step (which runs
        metadata inference) every gradient, the head's included, equals the
        step's own gradient.
        """
        ref, stage_mod, schedule = self._build(ignored_head=True)
        params = dict(stage_mod.named_parameters())
        self._step(schedule, 0)
        for name, ref_grad in self._ref_grads(ref, [0]).items():
            grad = params[name].grad
            if isinstance(grad, DTensor):
                grad = grad.full_tensor()
            self.assertEqual(grad, ref_grad, msg=name)

    def test_probe_gradients_cleared_without_fsdp_stage_root(self):
        """
        A last-stage module that is not an FSDP module, with sharded
        children (one of them the head that only the loss runs): after the
        first step (which runs metadata inference) every gradient equals the
        step's own gradient, as in 2.15.0, and so after the next step.
        """
        ref, stage_mod, schedule = self._build(sharded_head_root=False)
        params = dict(stage_mod.named_parameters())
        for step in range(2):
            self._step(schedule, step)
            for name, ref_grad in self._ref_grads(ref, [step]).items():
                grad = params[name].grad
                if isinstance(grad, DTensor):
                    grad = grad.full_tensor()
                self.assertEqual(grad, ref_grad, msg=f"step {step} {name}")
            for param in params.values():
                param.grad = None

    def test_non_root_stage_module_keeps_original_error(self):
        """
        A stage module that is not the FSDP root (its parent was sharded and
        ran forward first): when metadata inference fails, the user sees the
        original error, not one from resetting FSDP; eval then works.
        """
        torch.manual_seed(0)
        mesh = init_device_mesh("cpu", (self.world_size,))
        stage_mod = nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh())
        outer = nn.Sequential(stage_mod)
        fully_shard(stage_mod[0], mesh=mesh)
        fully_shard(stage_mod, mesh=mesh)
        fully_shard(outer, mesh=mesh)
        with torch.no_grad():
            outer(torch.randn(2, DIM))
        pp_group = dist.new_group([self.rank])
        stage = PipelineStage(stage_mod, 0, 1, torch.device("cpu"), group=pp_group)
        schedule = ScheduleGPipe(stage, n_microbatches=2, loss_fn=nn.MSELoss())

        def fail(module, args):
            raise RuntimeError("injected forward failure")

        handle = stage_mod[1].register_forward_pre_hook(fail)
        x = torch.randn(4, DIM)
        with self.assertRaisesRegex(RuntimeError, "injected forward failure"):
            schedule.eval(x, target=x)
        handle.remove()
        losses: list[torch.Tensor] = []
        schedule.eval(x, target=x, losses=losses)
        with torch.no_grad():
            self.assertEqual(
                torch.stack(losses).mean(),
                nn.functional.mse_loss(outer(x), x),
            )


if __name__ == "__main__":
    run_tests()
