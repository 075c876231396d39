# Owner(s): ["oncall: distributed"]
"""
Shared pieces of the torch-fsdp-lifecycle tests: a gloo/CPU multi-process test
case, collective counters and queries of a model's FSDP states, parameter
groups and policies, and random token data.

In torch 2.15.0, ``FSDPTest`` exits every rank with a skip when there are fewer
accelerators than ranks, so on a CPU-only machine an ``FSDPTest`` suite skips
everything and still looks green. These tests build on ``MultiProcessTestCase``
directly and initialize gloo on CPU in each rank. Upstream, these helpers belong
in ``torch/testing/_internal/common_fsdp.py``.
"""

import collections
import contextlib
import datetime
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
from torch.testing._internal.common_distributed import (
    MultiProcessTestCase,
    run_subtests,
)


class GlooMultiProcessTestCase(MultiProcessTestCase):
    """
    A ``MultiProcessTestCase`` whose ranks run on CPU with a gloo process
    group. Ranks are forked rather than spawned: each spawned rank would import
    torch again (about 5 s), and nothing here touches an accelerator.
    """

    # The process group's timeout (``None``: gloo's default of 30 minutes); a
    # test that checks how fast a rank fails sets a short one
    process_group_timeout: datetime.timedelta | None = None

    @property
    def world_size(self) -> int:
        return 2

    def setUp(self) -> None:
        super().setUp()
        self._start_processes(torch.multiprocessing.get_context("fork").Process)

    @classmethod
    def _run(cls, rank, test_name, file_name, pipe, **kwargs):  # type: ignore[override]
        self = cls(test_name)
        self.rank = rank
        self.file_name = file_name
        dist.init_process_group(
            backend="gloo",
            store=dist.FileStore(file_name, self.world_size),
            rank=rank,
            world_size=self.world_size,
            timeout=self.process_group_timeout,
        )
        # The ranks share the machine's cores: one intra-op thread each keeps
        # them from oversubscribing it (about 5x faster on two cores)
        torch.set_num_threads(1)
        torch.manual_seed(0)
        # ``run_test`` destroys the process group on exit
        self.run_test(test_name, pipe)

    def run_subtests(self, *args, **kwargs):
        return run_subtests(self, *args, **kwargs)


class CollectiveCounter:
    """
    Counts the collectives FSDP2 issues by wrapping the ``torch.distributed``
    functions it calls: ``all_gather_single``, ``reduce_scatter_single`` and
    ``all_reduce``. Counts are per kind and are taken only inside
    :meth:`count`. Bytes are this rank's buffer sizes: the unsharded input of a
    reduce-scatter, the unsharded output of an all-gather, the tensor of an
    all-reduce.
    """

    _FUNCTIONS = {
        "all_gather": "all_gather_single",
        "reduce_scatter": "reduce_scatter_single",
        "all_reduce": "all_reduce",
    }
    # Position and keyword names of the buffer whose size ``bytes`` counts
    _BUFFER_ARGS = {
        "all_gather": (0, ("output_tensor", "output")),
        "reduce_scatter": (1, ("input", "input_tensor")),
        "all_reduce": (0, ("tensor",)),
    }

    def __init__(self) -> None:
        self.counts: collections.Counter[str] = collections.Counter()
        self.bytes: collections.Counter[str] = collections.Counter()

    def __getitem__(self, kind: str) -> int:
        return self.counts[kind]

    def reset(self) -> None:
        self.counts.clear()
        self.bytes.clear()

    @contextlib.contextmanager
    def count(self) -> Iterator["CollectiveCounter"]:
        originals = {name: getattr(dist, name) for name in self._FUNCTIONS.values()}

        def wrap(kind, fn):
            position, keywords = self._BUFFER_ARGS[kind]

            def wrapper(*args, **kwargs):
                self.counts[kind] += 1
                # FSDP passes the buffers positionally or by keyword
                tensor = next((kwargs[k] for k in keywords if k in kwargs), None)
                if tensor is None and len(args) > position:
                    tensor = args[position]
                if isinstance(tensor, torch.Tensor):
                    self.bytes[kind] += tensor.numel() * tensor.element_size()
                return fn(*args, **kwargs)

            return wrapper

        try:
            for kind, name in self._FUNCTIONS.items():
                setattr(dist, name, wrap(kind, originals[name]))
            yield self
        finally:
            for name, fn in originals.items():
                setattr(dist, name, fn)


def fsdp_states(model: nn.Module) -> list[Any]:
    """The distinct FSDP states of ``model``'s FSDP modules, in module order."""
    states: dict[Any, None] = {}
    for module in model.modules():
        if isinstance(module, FSDPModule):
            states.setdefault(module._get_fsdp_state(), None)
    return list(states)


def fsdp_param_groups(model: nn.Module) -> list[FSDPParamGroup]:
    """The parameter groups of :func:`fsdp_states`, in state order."""
    return [g for state in fsdp_states(model) for g in state._fsdp_param_groups]


def param_group_name(group: FSDPParamGroup) -> str:
    """The group's module FQN(s), or ``"<root>"`` for the root's group."""
    return group._module_fqn or "<root>"


def fsdp_policies(model: nn.Module) -> dict[str, Any]:
    """Each FSDP module's current ``FSDPPolicy``, by module name."""
    return {
        name: module.get_fsdp_policy()
        for name, module in model.named_modules()
        if isinstance(module, FSDPModule)
    }


def random_token_microbatches(
    seed: int, num_microbatches: int, vocab_size: int, batch_size: int, seq_len: int
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """
    Returns ``(tokens, labels)``: ``num_microbatches`` random token tensors of
    shape ``(batch_size, seq_len)`` each, all tokens then all labels drawn from
    one generator seeded with ``seed``.
    """
    gen = torch.Generator().manual_seed(seed)
    tokens = [
        torch.randint(0, vocab_size, (batch_size, seq_len), generator=gen)
        for _ in range(num_microbatches)
    ]
    labels = [
        torch.randint(0, vocab_size, (batch_size, seq_len), generator=gen)
        for _ in range(num_microbatches)
    ]
    return tokens, labels
