# Owner(s): ["oncall: distributed"]
"""
Zero-bubble schedules (split input and weight backward) with FSDP2 stages
whose layers reshard after forward: the weight backward must find the
unsharded parameters the forward used. Reproducer of a 2.15.0 bug, where the
resharded layers' weight gradients were missing or wrong.

World 4 = PP2 x FSDP2, gloo on CPU.
"""

import copy
import os
import sys

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, ScheduleZBVZeroBubble
from torch.testing._internal.common_utils import (
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
)


sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from fsdp_lifecycle_testing import GlooMultiProcessTestCase  # noqa: E402


DIM = 8
DP = 2
NUM_MICROBATCHES = 4
LOCAL_BATCH = 8
LR = 0.1


class TestPipeliningFSDPZeroBubble(GlooMultiProcessTestCase):
    @property
    def world_size(self) -> int:
        return 4

    def test_zero_bubble_weight_gradients_reshard_after_forward(self):
        """
        Reproducer of a 2.15.0 bug: with a zero-bubble schedule (split input
        and weight backward), FSDP stages whose layers reshard after forward
        (the default) and a plain loss, every gradient equals the reference
        over several optimizer steps (2.15.0 skipped the resharded layers'
        weights in the weight backward).
        """
        self._train()

    def _train(self) -> None:
        torch.manual_seed(0)
        ref_model = nn.Sequential(*(nn.Linear(DIM, DIM) for _ in range(4)))
        model = copy.deepcopy(ref_model)
        mesh = init_device_mesh("cpu", (2, DP), mesh_dim_names=("pp", "dp"))
        pp_rank = mesh["pp"].get_local_rank()
        dp_rank = mesh["dp"].get_local_rank()
        stages, params = [], {}
        for stage_index in (pp_rank, 3 - pp_rank):  # V-shape placement
            stage_mod = nn.Sequential(model[stage_index])
            fully_shard(stage_mod[0], mesh=mesh["dp"])
            fully_shard(stage_mod, mesh=mesh["dp"])
            params.update(
                (f"{stage_index}.{name[2:]}", p)
                for name, p in stage_mod.named_parameters()
            )
            stages.append(
                PipelineStage(
                    stage_mod, stage_index, 4, torch.device("cpu"),
                    group=mesh["pp"].get_group(),
                )
            )
        stages.sort(key=lambda stage: stage.stage_index)
        schedule = ScheduleZBVZeroBubble(
            stages, n_microbatches=NUM_MICROBATCHES, loss_fn=nn.MSELoss()
        )
        optim = torch.optim.SGD(params.values(), lr=LR)
        ref_params = dict(ref_model.named_parameters())
        ref_optim = torch.optim.SGD(ref_params.values(), lr=LR)
        for step in range(2):
            gen = torch.Generator().manual_seed(step)
            x = torch.randn(DP * LOCAL_BATCH, DIM, generator=gen)
            y = torch.randn(DP * LOCAL_BATCH, DIM, generator=gen)
            local = slice(dp_rank * LOCAL_BATCH, (dp_rank + 1) * LOCAL_BATCH)
            if pp_rank == 0:  # holds stages 0 and 3
                schedule.step(x[local], target=y[local])
            else:
                schedule.step()
            nn.functional.mse_loss(ref_model(x), y).backward()
            for name, param in params.items():
                self.assertIsNotNone(param.grad, msg=f"step {step} {name}")
                self.assertEqual(
                    param.grad.full_tensor(), ref_params[name].grad,
                    msg=f"step {step} {name}",
                )
            optim.step()
            ref_optim.step()
            optim.zero_grad()
            ref_optim.zero_grad()


instantiate_parametrized_tests(TestPipeliningFSDPZeroBubble)


if __name__ == "__main__":
    run_tests()
