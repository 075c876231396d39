"""The README's API tour runs as written.

Its ``python`` block is executed unchanged on 2 CPU gloo ranks, with the model of
``tools/examples/chunked_loss.py`` (float64): ``shard`` builds the FSDP groups and
``train_step`` trains several steps. A reference copy sharded by the same
``shard`` trains with full logits and one backward per microbatch; the
parameters must match it after every step, must have moved, and the tour must
issue one reduce-scatter per FSDP group per step.
"""

import json
import subprocess
import sys

from tooling import REPO

EXAMPLE = REPO / "tools" / "examples" / "chunked_loss.py"
STEPS, MICROBATCHES, CHUNKS = 3, 2, 4

RUNNER = r'''
import collections, copy, importlib.util, json, os, sys, tempfile
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

example_path, tour_path, out_path, steps, microbatches, chunks = sys.argv[1:7]
steps, microbatches, chunks = int(steps), int(microbatches), int(chunks)
spec = importlib.util.spec_from_file_location("chunked_loss_example", example_path)
example = importlib.util.module_from_spec(spec)
spec.loader.exec_module(example)
with open(tour_path) as fh:
    TOUR = fh.read()


def full_tensors(model):
    return [p.full_tensor().detach().clone() for p in model.parameters()]


def run(rank, world_size, store_path):
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world_size), rank=rank,
                            world_size=world_size)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    tour = {"__name__": "readme_tour"}
    exec(compile(TOUR, "README.md (API tour)", "exec"), tour)
    base = example.Transformer().double()
    model = tour["shard"](copy.deepcopy(base))
    reference = tour["shard"](copy.deepcopy(base))
    fsdp_modules = sum(1 for m in model.modules() if hasattr(m, "partial_backward"))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_optim = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    initial = full_tensors(model)
    gen = torch.Generator().manual_seed(rank)
    result = {"fsdp_modules": fsdp_modules, "reduce_scatters": [], "reference_reduce_scatters": [],
              "max_diff": [], "moved": 0.0}
    for _ in range(steps):
        batches = [(torch.randint(0, example.VOCAB_SIZE, (example.BATCH_SIZE, example.SEQ_LEN), generator=gen),
                    torch.randint(0, example.VOCAB_SIZE, (example.BATCH_SIZE, example.SEQ_LEN), generator=gen))
                   for _ in range(microbatches)]
        counts = collections.Counter()
        with example.count_collectives(counts):
            tour["train_step"](model, optim, batches, chunks)
        result["reduce_scatters"].append(counts["rs"])
        counts = collections.Counter()
        with example.count_collectives(counts):
            for tokens, labels in batches:  # the reference: full logits, one backward per microbatch
                logits = reference.lm_head.finish_forward(reference.lm_head(reference(tokens)))
                loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
                (loss / labels.numel()).backward()
        result["reference_reduce_scatters"].append(counts["rs"])
        ref_optim.step()
        ref_optim.zero_grad()
        ours, ref = full_tensors(model), full_tensors(reference)
        result["max_diff"].append(max((a - b).abs().max().item() for a, b in zip(ours, ref)))
    result["moved"] = max((a - b).abs().max().item() for a, b in zip(full_tensors(model), initial))
    if rank == 0:
        with open(out_path, "w") as fh:
            json.dump(result, fh)
    dist.destroy_process_group()


with tempfile.TemporaryDirectory() as tmp:
    mp.start_processes(run, args=(2, os.path.join(tmp, "store")), nprocs=2, start_method="fork")
'''


def readme_tour() -> str:
    """The ``python`` block of the README's "API tour" section, as written."""
    section = (REPO / "README.md").read_text().split("\n## API tour\n", 1)[1].split("\n## ", 1)[0]
    blocks = section.split("```python\n")[1:]
    assert len(blocks) == 1, "the API tour has one python block"
    return blocks[0].split("```", 1)[0]


def test_readme_tour_trains_like_full_logits(tmp_path):
    import torch.distributed.fsdp as fsdp
    assert hasattr(fsdp.FSDPModule, "partial_backward"), \
        "the README tour needs the series applied to this torch (tools/run_tests.sh does that)"
    tour = tmp_path / "tour.py"
    tour.write_text(readme_tour())
    runner = tmp_path / "runner.py"
    runner.write_text(RUNNER)
    out = tmp_path / "result.json"
    proc = subprocess.run([sys.executable, str(runner), str(EXAMPLE), str(tour), str(out), str(STEPS),
                           str(MICROBATCHES), str(CHUNKS)], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0 and out.is_file(), proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    layers = 2  # tools/examples/chunked_loss.py's NUM_LAYERS
    # FSDP modules: each block, norm and lm_head (one group) and the root; groups: one fewer
    assert result["fsdp_modules"] == layers + 3, result
    assert result["reduce_scatters"] == [layers + 2] * STEPS, result
    # the reference reduces at every microbatch (10 per step here): the tour's policy saves the others
    assert all(n >= (layers + 2) * MICROBATCHES for n in result["reference_reduce_scatters"]), result
    assert len(result["max_diff"]) == STEPS and max(result["max_diff"]) < 1e-10, result
    assert result["moved"] > 1e-3, result  # the steps did train
