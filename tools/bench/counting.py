"""Counts the collectives FSDP2 issues, call by call, for the benchmarks.

The benchmarks' own counter (they do not import from ``test/``): it wraps the
``torch.distributed`` functions FSDP2 calls (``all_gather_single``,
``reduce_scatter_single``, ``all_reduce``) while :meth:`CallLog.count` is
active and keeps every call's kind and buffer size, and, given ``label_of``,
the label of the FSDP parameter group that issued it (the group whose
``unshard`` or ``post_backward`` is running; FSDP2-internal names, fine for a
benchmark), so calls can be totalled (:attr:`CallLog.counts`,
:attr:`CallLog.bytes`) or attributed to groups (:meth:`CallLog.sizes_by_group`).
The buffer is this rank's: the unsharded input of a reduce-scatter, the
unsharded output of an all-gather, the tensor of an all-reduce.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable, Iterator
from typing import Optional

import torch
import torch.distributed as dist

# kind -> (torch.distributed function, position and keyword names of the counted buffer)
_WRAPPED = {
    "all_gather": ("all_gather_single", 0, ("output_tensor", "output")),
    "reduce_scatter": ("reduce_scatter_single", 1, ("input", "input_tensor")),
    "all_reduce": ("all_reduce", 0, ("tensor",)),
}


class CallLog:
    """Every counted collective as ``(kind, numel, bytes, group label)``."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int, str]] = []
        self._group: list[str] = []

    def reset(self) -> None:
        self.calls.clear()

    @property
    def counts(self) -> collections.Counter[str]:
        return collections.Counter(kind for kind, _, _, _ in self.calls)

    @property
    def bytes(self) -> collections.Counter[str]:
        out: collections.Counter[str] = collections.Counter()
        for kind, _, nbytes, _ in self.calls:
            out[kind] += nbytes
        return out

    def sizes_by_group(self, kind: str) -> dict[str, dict[int, int]]:
        """``{group label: {buffer numel: calls}}`` for ``kind`` (a call smaller than the group's
        largest reduces only some of its parameters)."""
        out: dict[str, collections.Counter[int]] = {}
        for k, numel, _, label in self.calls:
            if k == kind:
                out.setdefault(label, collections.Counter())[numel] += 1
        return {label: dict(sorted(sizes.items())) for label, sizes in sorted(out.items())}

    @contextlib.contextmanager
    def _labelled(self, label_of: Callable[[object], str]) -> Iterator[None]:
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

        originals = {name: getattr(FSDPParamGroup, name) for name in ("unshard", "post_backward")}

        def wrap(fn):
            def method(group, *args, **kwargs):
                self._group.append(label_of(group))
                try:
                    return fn(group, *args, **kwargs)
                finally:
                    self._group.pop()

            return method

        try:
            for name, fn in originals.items():
                setattr(FSDPParamGroup, name, wrap(fn))
            yield
        finally:
            for name, fn in originals.items():
                setattr(FSDPParamGroup, name, fn)

    @contextlib.contextmanager
    def count(self, label_of: Optional[Callable[[object], str]] = None) -> Iterator["CallLog"]:
        """Record the collectives issued inside; ``label_of(param_group)`` labels them by group."""
        originals = {name: getattr(dist, name) for name, _, _ in _WRAPPED.values()}

        def wrap(kind: str, fn, position: int, keywords: tuple[str, ...]):
            def wrapper(*args, **kwargs):
                tensor = next((kwargs[k] for k in keywords if k in kwargs), None)
                if tensor is None and len(args) > position:
                    tensor = args[position]
                numel = tensor.numel() if isinstance(tensor, torch.Tensor) else 0
                size = numel * tensor.element_size() if isinstance(tensor, torch.Tensor) else 0
                self.calls.append((kind, numel, size, self._group[-1] if self._group else "other"))
                return fn(*args, **kwargs)

            return wrapper

        with contextlib.ExitStack() as stack:
            if label_of is not None:
                stack.enter_context(self._labelled(label_of))
            try:
                for kind, (name, position, keywords) in _WRAPPED.items():
                    setattr(dist, name, wrap(kind, originals[name], position, keywords))
                yield self
            finally:
                for name, fn in originals.items():
                    setattr(dist, name, fn)
