"""Reduce-scatters per step for PP2 x FSDP2 with a chunked loss on the last stage.

World 4 (gloo, CPU): a 2x2 mesh ("pp", "dp"), a tiny LM split into pipeline
stages, every stage ``fully_shard``-ed on "dp" (each layer, the ``lm_head``,
and the stage root). The schedule's ``loss_fn`` is a chunked loss that runs its
head backwards inside the forward action, as torchtitan's does on the last
stage: on a torch with this series they run under ``lm_head.partial_backward()``,
on pristine 2.15.0 as plain backwards (the only option there).

With ``--loss torchtitan`` the loss is torchtitan's own ``ChunkedLossWrapper``
instead (``torchtitan.components.loss``; it keeps the head unsharded and forces
its gradient sync on for the last chunk).

For each schedule it prints, per rank, the number of FSDP parameter groups
(the minimum: one reduce-scatter per group per finalized step), the
reduce-scatters of step 1 (which also runs metadata inference) and step 2, and
step 2's all-gathers, all-reduces and bytes (reduce-scatter input, all-gather
output; the all-reduce count includes the schedule's own metadata traffic).

    python tools/bench/pp_collectives.py [--schedules GPipe,1F1B,...] [--loss api|torchtitan]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZBVZeroBubble,
)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import CollectiveCounter  # noqa: E402

VOCAB, DIM, SEQ, NUM_LAYERS = 16, 8, 4, 4
NUM_MICROBATCHES, MICROBATCH_SIZE, NUM_CHUNKS = 4, 2, 2
HAS_PARTIAL_BACKWARD = hasattr(FSDPModule, "partial_backward")
# name -> (schedule class, number of stages)
SCHEDULES = {
    "GPipe": (ScheduleGPipe, 2),
    "1F1B": (Schedule1F1B, 2),
    "Interleaved1F1B": (ScheduleInterleaved1F1B, 4),
    "ZBVZeroBubble": (ScheduleZBVZeroBubble, 4),
}


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x))


class StageModule(nn.Module):
    def __init__(self, layer_ids: range, *, first: bool, last: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM) if first else None
        self.layers = nn.ModuleDict({str(i): Layer() for i in layer_ids})
        self.norm = nn.LayerNorm(DIM) if last else None
        # The chunked loss applies the head; forward stops before it
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False) if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for layer in self.layers.values():
            x = layer(x)
        return self.norm(x) if self.norm is not None else x


def stage_indices(name: str, num_stages: int, pp_rank: int) -> list[int]:
    if name == "ZBVZeroBubble":  # V shape: stages pp_rank and its mirror
        return sorted([pp_rank, num_stages - 1 - pp_rank])
    return list(range(pp_rank, num_stages, 2))


def make_torchtitan_loss(lm_head: nn.Module | None):
    from torchtitan.components.loss import ChunkedLossWrapper

    wrapper = ChunkedLossWrapper(ChunkedLossWrapper.Config(num_chunks=NUM_CHUNKS))
    if lm_head is not None:
        wrapper.set_lm_head(lm_head)

    def loss_fn(h: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss, _ = wrapper(h, target, torch.tensor(float(target.numel())))
        return loss

    return loss_fn


def make_chunked_loss(lm_head: nn.Module | None):
    def loss_fn(h: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        train = h.requires_grad and torch.is_grad_enabled()
        h_detached = h.detach().requires_grad_(train)
        scope = (
            lm_head.partial_backward()
            if train and HAS_PARTIAL_BACKWARD
            else contextlib.nullcontext()
        )
        total = h.new_zeros(())
        with scope:
            for h_chunk, t_chunk in zip(
                h_detached.chunk(NUM_CHUNKS, dim=1), target.chunk(NUM_CHUNKS, dim=1)
            ):
                logits = lm_head(h_chunk)
                loss = F.cross_entropy(
                    logits.flatten(0, 1), t_chunk.flatten(), reduction="sum"
                ) / target.numel()
                if train:
                    loss.backward()
                total = total + loss.detach()
        if not train:
            return total
        # Route the accumulated hidden-state gradient into the stage backward
        surrogate = (h * h_detached.grad).sum()
        return surrogate - surrogate.detach() + total

    return loss_fn


def worker(
    rank: int, store_path: str, schedules: list[str], loss: str, queue
) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", store=dist.FileStore(store_path, 4), rank=rank, world_size=4
    )
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp_rank = mesh["pp"].get_local_rank()
    for name in schedules:
        schedule_cls, num_stages = SCHEDULES[name]
        torch.manual_seed(0)
        modules, stages, num_groups = {}, [], 0
        for i in stage_indices(name, num_stages, pp_rank):
            per_stage = NUM_LAYERS // num_stages
            module = StageModule(
                range(i * per_stage, (i + 1) * per_stage),
                first=i == 0,
                last=i == num_stages - 1,
            )
            for layer in module.layers.values():
                fully_shard(layer, mesh=mesh["dp"])
            if module.lm_head is not None:
                fully_shard(module.lm_head, mesh=mesh["dp"])
            fully_shard(module, mesh=mesh["dp"])
            num_groups += sum(
                len(m._get_fsdp_state()._fsdp_param_groups)
                for m in module.modules()
                if isinstance(m, FSDPModule)
            )
            modules[i] = module
            stages.append(
                PipelineStage(
                    module, i, num_stages, torch.device("cpu"),
                    group=mesh["pp"].get_group(),
                )
            )
        last = modules.get(num_stages - 1)
        schedule = schedule_cls(
            stages[0] if len(stages) == 1 else stages,
            n_microbatches=NUM_MICROBATCHES,
            loss_fn=(make_torchtitan_loss if loss == "torchtitan" else make_chunked_loss)(
                last.lm_head if last is not None else None
            ),
        )
        counts, counter = [], CollectiveCounter()
        for step in range(2):
            gen = torch.Generator().manual_seed(step)
            size = (NUM_MICROBATCHES * MICROBATCH_SIZE, SEQ)
            tokens = torch.randint(0, VOCAB, size, generator=gen)
            labels = torch.randint(0, VOCAB, size, generator=gen)
            args = (tokens,) if 0 in modules else ()
            kwargs = {"target": labels} if last is not None else {}
            counter.reset()
            with counter.count():
                schedule.step(*args, **kwargs)
            for module in modules.values():
                module.zero_grad(set_to_none=True)
            counts.append(counter.counts["reduce_scatter"])
        step2 = (
            counter.counts["all_gather"],
            counter.counts["all_reduce"],
            counter.bytes["reduce_scatter"],
            counter.bytes["all_gather"],
        )
        queue.put((name, rank, num_groups, counts, step2))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedules", default=",".join(SCHEDULES))
    parser.add_argument(
        "--loss",
        choices=("api", "torchtitan"),
        default="api",
        help="api: the chunked loss above (partial_backward where available); "
        "torchtitan: torchtitan's ChunkedLossWrapper",
    )
    args = parser.parse_args()
    schedules = args.schedules.split(",")
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [
            ctx.Process(
                target=worker,
                args=(r, os.path.join(tmp, "store"), schedules, args.loss, queue),
            )
            for r in range(4)
        ]
        for p in procs:
            p.start()
        results = collections.defaultdict(dict)
        for _ in range(4 * len(schedules)):
            name, rank, num_groups, counts, step2 = queue.get(timeout=900)
            results[name][rank] = (num_groups, counts, step2)
        for p in procs:
            p.join()
    if args.loss == "torchtitan":
        variant = "torchtitan ChunkedLossWrapper"
    else:
        variant = "partial_backward" if HAS_PARTIAL_BACKWARD else "plain inner backwards"
    print(f"torch {torch.__version__} ({variant}): collectives per step, PP2 x FSDP2")
    print(
        "| schedule | rank | FSDP groups (minimum) | RS step 1 | RS step 2 "
        "| AG step 2 | AR step 2 | bytes RS/AG step 2 |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name in schedules:
        for rank in sorted(results[name]):
            num_groups, counts, (ag, ar, rs_bytes, ag_bytes) = results[name][rank]
            print(
                f"| {name} | {rank} | {num_groups} | {counts[0]} | {counts[1]} "
                f"| {ag} | {ar} | {rs_bytes / 1024:.1f}/{ag_bytes / 1024:.1f} KiB |"
            )


if __name__ == "__main__":
    main()
