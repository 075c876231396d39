"""The ``main`` of the scripts that ``generator.script()`` writes: spawns the ranks
of a generated program's ``body(rank, world, ctx)`` on gloo and reports how it
ended. A script imports this module and its runtime (``genlib_fsdp`` or
``genlib_pp``) from tools/parity, so it holds only the program.

Oracle B scripts exit 1 with ``FAILED: <check>: <detail>`` when a check of the
program fails. Oracle A scripts (``trace=True``) print rank 0's collectives per
operation and exit 0: run them on the pristine and on the patched torch and
compare the two outputs.
"""

import datetime
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TRACED = ("all_gather_single", "reduce_scatter_single", "all_reduce")


class Ctx:
    """Oracle B's checks raise; with ``trace``, rank 0 prints phases and collectives."""

    def __init__(self, rank, trace):
        self.rank, self.trace = rank, trace and rank == 0
        if self.trace:
            for name in TRACED:
                setattr(dist, name, self._traced(name, getattr(dist, name)))

    def _traced(self, name, fn):
        def wrapper(*args, **kwargs):
            sizes = [a.numel() for a in [*args, *kwargs.values()] if isinstance(a, torch.Tensor)]
            print(f"  {name} {sizes}", flush=True)
            return fn(*args, **kwargs)

        return wrapper

    def check(self, what, ok, detail=""):
        if not ok:
            raise AssertionError(f"{what}: {detail}")

    def phase(self, label):
        if self.trace:
            print(label, flush=True)

    def __getattr__(self, name):  # the parity worker's recording hooks: nothing here
        return lambda *args, **kwargs: None


def _rank(rank, world, store, body, trace, timeout_s):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    body(rank, world, Ctx(rank, trace))
    dist.destroy_process_group()


def main(body, world, trace=False, timeout_s=20.0):
    """``timeout_s``: the process-group timeout (short for a program in which one rank fails)."""
    with tempfile.TemporaryDirectory() as tmp:
        try:
            mp.spawn(_rank, args=(world, tmp + "/store", body, trace, timeout_s), nprocs=world)
        except Exception as exc:  # noqa: BLE001 - the failure the script reproduces
            print(f"FAILED: {str(exc).strip().splitlines()[-1]}")
            sys.exit(1)
    print("passed")
