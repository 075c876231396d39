"""Reduce-scatters per step for PP2 x FSDP2 with a chunked loss on the last stage (benchmark 1b).

World 4 (gloo, CPU, :func:`common.launch`): a 2x2 mesh ("pp", "dp"), the
benchmarks' tiny LM (:class:`common.TinyLM`, vocab 16, dim 8, 4 layers) cut
into pipeline stages (:class:`common.Stage`), every stage ``fully_shard``-ed on
"dp" (each layer, the ``lm_head``, and the stage root). The schedule's
``loss_fn`` is a chunked loss that runs its head backwards inside the forward
action, as torchtitan's does on the last stage: on a torch with this series
they run under ``lm_head.partial_backward()``, on pristine 2.15.0 as plain
backwards (the only option there).

With ``--loss torchtitan`` the loss is torchtitan's own ``ChunkedLossWrapper``
instead (``torchtitan.components.loss``; it keeps the head unsharded and forces
its gradient sync on for the last chunk).

For each schedule and rank it records the number of FSDP parameter groups
(the minimum: one reduce-scatter per group per finalized step), the
reduce-scatters of step 1 (which also runs metadata inference) and step 2, and
step 2's all-gathers, all-reduces and bytes (reduce-scatter input, all-gather
output; the all-reduce count includes the schedule's own metadata traffic).

    python tools/bench/pp_collectives.py [--schedules GPipe,1F1B,...] [--loss api|torchtitan] [--json F]
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

import torch
import torch.distributed as dist
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import render  # noqa: E402
import results  # noqa: E402
from counting import CallLog  # noqa: E402

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
        scope = lm_head.partial_backward() if train and HAS_PARTIAL_BACKWARD else contextlib.nullcontext()
        total = h.new_zeros(())
        with scope:
            for h_chunk, t_chunk in zip(h_detached.chunk(NUM_CHUNKS, dim=1), target.chunk(NUM_CHUNKS, dim=1)):
                loss = F.cross_entropy(lm_head(h_chunk).flatten(0, 1), t_chunk.flatten(),
                                       reduction="sum") / target.numel()
                if train:
                    loss.backward()
                total = total + loss.detach()
        if not train:
            return total
        # Route the accumulated hidden-state gradient into the stage backward
        surrogate = (h * h_detached.grad).sum()
        return surrogate - surrogate.detach() + total

    return loss_fn


def _stages(name: str, mesh, pp_rank: int):
    """This rank's stage modules (FSDP on "dp"), pipeline stages and FSDP group count."""
    _, num_stages = SCHEDULES[name]
    torch.manual_seed(0)
    model = common.TinyLM(vocab_size=VOCAB, dim=DIM, num_layers=NUM_LAYERS)
    per_stage = NUM_LAYERS // num_stages
    modules, stages, num_groups = {}, [], 0
    for i in stage_indices(name, num_stages, pp_rank):
        module = common.Stage(model, range(i * per_stage, (i + 1) * per_stage),
                              first=i == 0, last=i == num_stages - 1)
        for layer in module.layers.values():
            fully_shard(layer, mesh=mesh["dp"])
        if module.lm_head is not None:
            fully_shard(module.lm_head, mesh=mesh["dp"])
        fully_shard(module, mesh=mesh["dp"])
        num_groups += sum(len(m._get_fsdp_state()._fsdp_param_groups)
                          for m in module.modules() if isinstance(m, FSDPModule))
        modules[i] = module
        stages.append(PipelineStage(module, i, num_stages, torch.device("cpu"), group=mesh["pp"].get_group()))
    return modules, stages, num_groups


def run(rank: int, world_size: int, schedules: list[str], loss: str) -> list[dict]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp_rank = mesh["pp"].get_local_rank()
    rows = []
    for name in schedules:
        schedule_cls, num_stages = SCHEDULES[name]
        modules, stages, num_groups = _stages(name, mesh, pp_rank)
        last = modules.get(num_stages - 1)
        schedule = schedule_cls(
            stages[0] if len(stages) == 1 else stages, n_microbatches=NUM_MICROBATCHES,
            loss_fn=(make_torchtitan_loss if loss == "torchtitan" else make_chunked_loss)(
                last.lm_head if last is not None else None))
        rs, log = [], CallLog()
        for step in range(2):
            gen = torch.Generator().manual_seed(step)
            size = (NUM_MICROBATCHES * MICROBATCH_SIZE, SEQ)
            tokens = torch.randint(0, VOCAB, size, generator=gen)
            labels = torch.randint(0, VOCAB, size, generator=gen)
            log.reset()
            with log.count():
                schedule.step(*((tokens,) if 0 in modules else ()), **({"target": labels} if last else {}))
            for module in modules.values():
                module.zero_grad(set_to_none=True)
            rs.append(log.counts["reduce_scatter"])
        rows.append({"schedule": name, "rank": rank, "groups": num_groups, "rs_step1": rs[0], "rs_step2": rs[1],
                     "ag_step2": log.counts["all_gather"], "ar_step2": log.counts["all_reduce"],
                     "rs_bytes": log.bytes["reduce_scatter"], "ag_bytes": log.bytes["all_gather"]})
    gathered: list = [None] * world_size
    dist.all_gather_object(gathered, rows)
    return [row for rank_rows in gathered for row in rank_rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedules", default=",".join(SCHEDULES))
    parser.add_argument("--loss", choices=("api", "torchtitan"), default="api",
                        help="api: the chunked loss above (partial_backward where available); "
                             "torchtitan: torchtitan's ChunkedLossWrapper")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    load_before = results.load()
    rows = common.launch(run, 4, args.schedules.split(","), args.loss)
    if isinstance(rows, dict):
        sys.exit(rows["error"])
    if args.loss == "torchtitan":
        variant = "torchtitan ChunkedLossWrapper"
    else:
        variant = "partial_backward" if HAS_PARTIAL_BACKWARD else "plain inner backwards"
    params = {"vocab": VOCAB, "dim": DIM, "seq": SEQ, "layers": NUM_LAYERS, "microbatches": NUM_MICROBATCHES,
              "microbatch_size": MICROBATCH_SIZE, "num_chunks": NUM_CHUNKS, "loss": args.loss, "variant": variant}
    results.write(args.json, "pp_collectives", params, rows, load_before, torch.__version__)
    print(f"torch {torch.__version__} ({variant}): collectives per step, PP2 x FSDP2")
    print(render.pp_rank_table(rows))


if __name__ == "__main__":
    main()
