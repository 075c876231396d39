# Owner(s): ["oncall: distributed"]
"""
Tests for the value-based FSDP2 policy API (pytorch/pytorch#203177) on FSDP
modules: ``FSDPModule.get_fsdp_policy``, ``FSDPModule.set_fsdp_policy`` and
``FSDPModule.fsdp_policy``. The ``FSDPPolicy`` value itself is tested in
``test_fully_shard_policy_value.py``.

Every multi-process test runs gloo on CPU through ``GlooMultiProcessTestCase``
(``FSDPTest`` skips every test on a CPU-only machine in torch 2.15.0).
"""

import collections
import contextlib
import copy
import dataclasses
import enum
import os
import sys
from collections.abc import Iterator
from typing import Any
from unittest import mock

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
import torch.nn as nn
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import (
    DataParallelMeshDims,
    FSDPModule,
    FSDPPolicy,
    fully_shard,
)
from torch.distributed.fsdp._fully_shard._fsdp_common import (
    FSDPMeshInfo,
    ShardPlacementResult,
)
from torch.distributed.tensor import distribute_tensor, DTensor, Replicate, Shard
from torch.testing._internal.common_utils import (
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
)


sys.path.insert(
    0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
)
from fsdp_lifecycle_testing import (  # noqa: E402
    CollectiveCounter,
    fsdp_param_groups,
    fsdp_policies,
    fsdp_states,
    GlooMultiProcessTestCase,
)


DIM = 8
NUM_MICROBATCHES = 3


# ---------------------------------------------------------------------------
# Models and helpers
# ---------------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


class Model(nn.Module):
    """``embed -> body (blocks) -> norm -> lm_head``."""

    def __init__(self, dim: int = DIM, num_blocks: int = 2) -> None:
        super().__init__()
        self.embed = nn.Linear(dim, dim)
        self.body = nn.Sequential(*[Block(dim) for _ in range(num_blocks)])
        self.norm = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(self.body(self.embed(x))))


_UNSET: Any = object()


def _shard(
    model: Model,
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: Any = None,
    root_reshard_after_forward: Any = _UNSET,
    shard_body: bool = False,
    group_head: bool = False,
) -> Model:
    """
    ``fully_shard`` each block, optionally the parameterless ``body`` container
    and the grouped ``[norm, lm_head]``, then the root.
    """
    for block in model.body:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward)
    if shard_body:
        fully_shard(model.body, mesh=mesh, reshard_after_forward=reshard_after_forward)
    if group_head:
        fully_shard(
            [model.norm, model.lm_head],
            mesh=mesh,
            reshard_after_forward=reshard_after_forward,
        )
    if root_reshard_after_forward is _UNSET:
        root_reshard_after_forward = reshard_after_forward
    fully_shard(model, mesh=mesh, reshard_after_forward=root_reshard_after_forward)
    return model


def _fsdp_modules(model: nn.Module) -> list[FSDPModule]:
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


# Values compared with ``==``; everything else is compared by identity
_PLAIN_TYPES = (bool, int, float, str, bytes, type(None), enum.Enum)
_CONTAINER_TYPES = (list, tuple, dict, set, frozenset)


def _freeze(value: Any, depth: int = 0) -> tuple:
    """
    Freezes ``value`` for comparison: plain values by value, containers by
    identity and (shallowly, recursively) by their items, and any other object
    (tensors, meshes, mesh infos, process groups, hook handles, ...) by
    identity. The snapshot holds references, so identities stay valid.
    """
    if isinstance(value, _PLAIN_TYPES):
        return ("plain", type(value), value)
    if type(value) in _CONTAINER_TYPES and depth < 4:
        if isinstance(value, dict):
            items = tuple(
                (_freeze(k, depth + 1), _freeze(v, depth + 1)) for k, v in value.items()
            )
        elif isinstance(value, (set, frozenset)):
            items = tuple(sorted((_freeze(v, depth + 1) for v in value), key=repr))
        else:
            items = tuple(_freeze(v, depth + 1) for v in value)
        return ("container", value, items)
    return ("object", value)


def _same(a: tuple, b: tuple) -> bool:
    if a[0] != b[0]:
        return False
    if a[0] == "plain":
        return a[1] is b[1] and a[2] == b[2]
    if a[0] == "object":
        return a[1] is b[1]
    if a[1] is not b[1] or len(a[2]) != len(b[2]):
        return False
    for x, y in zip(a[2], b[2]):
        if isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], tuple):
            # dict item: (key, value)
            if not (_same(x[0], y[0]) and _same(x[1], y[1])):
                return False
        elif not _same(x, y):
            return False
    return True


def _snapshot(model: nn.Module) -> dict[str, dict[str, tuple]]:
    """
    Every internal field of every FSDP state, its shared state context, and
    every parameter group in ``model``.
    """
    snapshot: dict[str, dict[str, tuple]] = {}
    for i, state in enumerate(fsdp_states(model)):
        snapshot[f"state{i}"] = {k: _freeze(v) for k, v in vars(state).items()}
        snapshot[f"state{i}._state_ctx"] = {
            k: _freeze(v) for k, v in vars(state._state_ctx).items()
        }
        for j, group in enumerate(state._fsdp_param_groups):
            snapshot[f"state{i}.group{j}"] = {
                k: _freeze(v) for k, v in vars(group).items()
            }
    return snapshot


@contextlib.contextmanager
def _count_mesh_and_group_creation() -> Iterator[collections.Counter]:
    """Counts ``DeviceMesh`` constructions and process group creations."""
    counts: collections.Counter[str] = collections.Counter()

    def counting(kind: str, fn):
        def wrapper(*args, **kwargs):
            counts[kind] += 1
            return fn(*args, **kwargs)

        return wrapper

    with contextlib.ExitStack() as stack:
        stack.enter_context(
            mock.patch.object(
                DeviceMesh, "__init__", counting("mesh", DeviceMesh.__init__)
            )
        )
        for name in ("new_group", "split_group", "_new_group_with_tag"):
            if hasattr(c10d, name):
                fn = getattr(c10d, name)
                stack.enter_context(
                    mock.patch.object(c10d, name, counting("group", fn))
                )
                if getattr(dist, name, None) is fn:
                    stack.enter_context(
                        mock.patch.object(dist, name, counting("group", fn))
                    )
        yield counts


def _loss(out: torch.Tensor) -> torch.Tensor:
    # A mean over rows: the reference's mean over every rank's rows equals the
    # average over ranks of the local means, which is what FSDP reduces
    return out.square().mean()


def _all_inputs(local: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Every rank's microbatch inputs, ordered by rank."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    return gathered


def _local_inputs(rank: int, num_microbatches: int, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed + 1000 * rank)
    return [torch.randn(4, DIM, generator=generator) for _ in range(num_microbatches)]


# ---------------------------------------------------------------------------
# World size 2: round trip (bool / automatic), grouping, scopes, defaults
# ---------------------------------------------------------------------------
class _PolicyTestBase(GlooMultiProcessTestCase):
    """Shared assertions; holds no tests."""

    def _assert_same_snapshot(self, before, after, where: str) -> None:
        self.assertEqual(before.keys(), after.keys(), where)
        for obj_name, fields in before.items():
            self.assertEqual(
                fields.keys(), after[obj_name].keys(), f"{where}: {obj_name}"
            )
            for field, value in fields.items():
                self.assertTrue(
                    _same(value, after[obj_name][field]),
                    f"{where}: {obj_name}.{field} changed: {value} -> "
                    f"{after[obj_name][field]}",
                )

    def _check_grads_and_step(
        self, model, ref_model, optim, ref_optim, where: str = ""
    ) -> None:
        """Assert every gradient equals the reference's, then step and zero both."""
        for (name, param), ref_param in zip(
            model.named_parameters(), ref_model.parameters()
        ):
            msg = f"{where}: {name}" if where else name
            self.assertEqual(param.grad.full_tensor(), ref_param.grad, msg=msg)
        optim.step()
        ref_optim.step()
        optim.zero_grad()
        ref_optim.zero_grad()

    def _round_trip(self, model: Model, recurse: bool, where: str) -> None:
        """Round trips every FSDP module, asserting nothing changes at all."""
        before = _snapshot(model)
        policies = fsdp_policies(model)
        with _count_mesh_and_group_creation() as created:
            if recurse:
                model.set_fsdp_policy(model.get_fsdp_policy(), recurse=True)
            for module in _fsdp_modules(model):
                module.set_fsdp_policy(module.get_fsdp_policy(), recurse=recurse)
            with model.fsdp_policy(recurse=recurse) as applied:
                self.assertEqual(applied, policies[""])
        self.assertEqual(created["mesh"], 0, where)
        self.assertEqual(created["group"], 0, where)
        self.assertEqual(fsdp_policies(model), policies, where)
        self._assert_same_snapshot(before, _snapshot(model), where)


class TestFullyShardPolicy(_PolicyTestBase):
    @property
    def world_size(self) -> int:
        return 2

    def _train_step(self, model: nn.Module, inp: torch.Tensor) -> None:
        _loss(model(inp)).backward()

    @staticmethod
    def _expected_raf(raf, is_root: bool):
        """The post-forward mesh FSDP uses: None, 'mesh' (the group's own)."""
        if raf is None:
            return None if is_root else "mesh"
        return "mesh" if raf else None

    def test_round_trip_exact(self):
        """
        ``set_fsdp_policy(get_fsdp_policy())`` changes no internal field, before
        and after lazy init (and mid-iteration), for bool and automatic
        ``reshard_after_forward``, with and without ``recurse``.
        """
        self.run_subtests(
            {
                "reshard_after_forward": [None, True, False],
                "recurse": [False, True],
                "group_head": [False, True],
            },
            self._test_round_trip_exact,
        )

    def _test_round_trip_exact(self, reshard_after_forward, recurse, group_head):
        torch.manual_seed(0)
        model = _shard(
            Model(),
            reshard_after_forward=reshard_after_forward,
            group_head=group_head,
        )
        expected_policy = FSDPPolicy(reshard_after_forward=reshard_after_forward)
        for name, policy in fsdp_policies(model).items():
            self.assertEqual(policy, expected_policy, name)
        root_groups = model._get_fsdp_state()._fsdp_param_groups
        # Before lazy init, automatic means resharding for every group
        for group in fsdp_param_groups(model):
            expected = self._expected_raf(reshard_after_forward, is_root=False)
            if expected == "mesh":
                self.assertIs(group.post_forward_mesh_info, group.mesh_info)
            else:
                self.assertIsNone(group.post_forward_mesh_info)
        self._round_trip(model, recurse, "before lazy init")

        inp = torch.randn(4, DIM)
        self._train_step(model, inp)
        # After lazy init the root keeps its parameters after forward when
        # automatic; the round trip must keep that choice
        for group in root_groups:
            expected = self._expected_raf(reshard_after_forward, is_root=True)
            if expected == "mesh":
                self.assertIs(group.post_forward_mesh_info, group.mesh_info)
            else:
                self.assertIsNone(group.post_forward_mesh_info)
        self.assertEqual(model.get_fsdp_policy(), expected_policy)
        self._round_trip(model, recurse, "after lazy init")
        for group in root_groups:
            if reshard_after_forward is None:
                self.assertIsNone(group.post_forward_mesh_info)

        # Mid-iteration: between forward and backward
        out = model(inp)
        self._round_trip(model, recurse, "after forward")
        _loss(out).backward()
        self._round_trip(model, recurse, "after backward")

    def test_grouped_and_parameterless(self):
        """
        Modules given to one ``fully_shard`` call share one policy, and a state
        without parameters keeps and returns its policy.
        """
        self.run_subtests(
            {"reshard_after_forward": [None, False]},
            self._test_grouped_and_parameterless,
        )

    def _test_grouped_and_parameterless(self, reshard_after_forward):
        torch.manual_seed(0)
        model = _shard(
            Model(),
            reshard_after_forward=reshard_after_forward,
            shard_body=True,
            group_head=True,
        )
        norm, lm_head, body = model.norm, model.lm_head, model.body
        self.assertIs(norm._get_fsdp_state(), lm_head._get_fsdp_state())
        self.assertEqual(len(body._get_fsdp_state()._fsdp_param_groups), 0)
        default = FSDPPolicy(reshard_after_forward=reshard_after_forward)
        self.assertEqual(norm.get_fsdp_policy(), default)
        self.assertEqual(body.get_fsdp_policy(), default)

        # Grouped: set through one module, read through the other
        grouped = FSDPPolicy(
            requires_all_reduce=False,
            reshard_after_forward=False,
            reshard_after_backward=False,
        )
        norm.set_fsdp_policy(grouped, recurse=False)
        self.assertEqual(lm_head.get_fsdp_policy(), grouped)
        self.assertEqual(norm.get_fsdp_policy(), grouped)
        (group,) = lm_head._get_fsdp_state()._fsdp_param_groups
        self.assertFalse(group.all_reduce_grads)
        self.assertTrue(group.reduce_grads)
        self.assertFalse(group.reshard_after_backward)
        self.assertIsNone(group.post_forward_mesh_info)
        with lm_head.fsdp_policy(
            requires_gradient_sync=False, recurse=False
        ) as applied:
            self.assertEqual(
                applied, dataclasses.replace(grouped, requires_gradient_sync=False)
            )
            self.assertEqual(norm.get_fsdp_policy(), applied)
        self.assertEqual(norm.get_fsdp_policy(), grouped)
        lm_head.set_fsdp_policy(default, recurse=False)
        self.assertEqual(norm.get_fsdp_policy(), default)
        # The other modules were not touched
        self.assertEqual(model.get_fsdp_policy(), default)
        self.assertEqual(model.body[0].get_fsdp_policy(), default)

        # A single group cannot disagree with itself: a private field edit is
        # what ``get`` then reads
        group.reduce_grads = False
        self.assertFalse(lm_head.get_fsdp_policy().requires_gradient_sync)
        group.reduce_grads = True

        # Parameterless: set/get, scopes, setters, and recurse from the root
        for policy in (
            FSDPPolicy(requires_gradient_sync=False, reshard_after_backward=False),
            FSDPPolicy(requires_all_reduce=False, reshard_after_forward=True),
            default,
        ):
            body.set_fsdp_policy(policy, recurse=False)
            self.assertEqual(body.get_fsdp_policy(), policy)
            self.assertEqual(model.body[0].get_fsdp_policy(), default)
        with body.fsdp_policy(requires_all_reduce=False, recurse=False) as applied:
            self.assertEqual(
                applied, dataclasses.replace(default, requires_all_reduce=False)
            )
            self.assertEqual(body.get_fsdp_policy(), applied)
        self.assertEqual(body.get_fsdp_policy(), default)
        scoped = FSDPPolicy(requires_gradient_sync=False, reshard_after_forward=False)
        with model.fsdp_policy(scoped, recurse=True) as applied:
            self.assertEqual(applied, scoped)
            for name, policy in fsdp_policies(model).items():
                self.assertEqual(policy, scoped, name)
        for name, policy in fsdp_policies(model).items():
            self.assertEqual(policy, default, name)
        model.set_fsdp_policy(scoped, recurse=True)
        self.assertEqual(body.get_fsdp_policy(), scoped)
        model.set_fsdp_policy(default, recurse=True)
        self.assertEqual(body.get_fsdp_policy(), default)
        # The per-field setters keep a parameterless policy in step
        body.set_requires_gradient_sync(False, recurse=False)
        self.assertEqual(
            body.get_fsdp_policy(),
            dataclasses.replace(
                default, requires_gradient_sync=False, requires_all_reduce=False
            ),
        )
        body.set_requires_gradient_sync(True, recurse=False)
        body.set_reshard_after_backward(False, recurse=False)
        self.assertFalse(body.get_fsdp_policy().reshard_after_backward)
        body.set_reshard_after_backward(True, recurse=False)
        self.assertEqual(body.get_fsdp_policy(), default)

        # And it all still trains, with round trips exact after lazy init
        _loss(model(torch.randn(4, DIM))).backward()
        self.assertEqual(body.get_fsdp_policy(), default)
        before = _snapshot(model)
        for module in _fsdp_modules(model):
            module.set_fsdp_policy(module.get_fsdp_policy(), recurse=False)
        with model.fsdp_policy(recurse=True):
            pass
        after = _snapshot(model)
        for obj_name, fields in before.items():
            for field, value in fields.items():
                self.assertTrue(_same(value, after[obj_name][field]), field)

    def _scope_setup(self):
        """A lazily initialized model whose ``body.0`` has a non-default
        policy that scopes must keep and restore, its policies and a
        snapshot of every FSDP object's fields."""
        torch.manual_seed(0)
        model = _shard(Model(), group_head=True)
        block0, block1 = model.body
        # Give block0 a non-default policy that scopes must keep and restore
        block0_policy = FSDPPolicy(
            requires_all_reduce=False, reshard_after_forward=False
        )
        block0.set_fsdp_policy(block0_policy, recurse=False)
        _loss(model(torch.randn(4, DIM))).backward()  # lazy init
        state_ctx = model._get_fsdp_state()._state_ctx
        self.assertTrue(state_ctx.is_last_backward)
        policies = fsdp_policies(model)
        root_policy = policies[""]
        self.assertEqual(root_policy, FSDPPolicy())
        self.assertEqual(policies["body.0"], block0_policy)
        snapshot = _snapshot(model)
        return model, block0, block1, block0_policy, state_ctx, policies, root_policy, snapshot

    def test_fsdp_policy_scope_keywords(self):
        """Omitted keywords keep the current value; only ``self`` changes."""
        (
            model, block0, block1, block0_policy, state_ctx, policies, root_policy, snapshot
        ) = self._scope_setup()
        # Keyword: omitted keywords keep the current value; only self changes
        with block0.fsdp_policy(reshard_after_backward=False, recurse=False) as applied:
            expected = dataclasses.replace(block0_policy, reshard_after_backward=False)
            self.assertEqual(applied, expected)
            self.assertEqual(block0.get_fsdp_policy(), expected)
            (block0_group,) = block0._get_fsdp_state()._fsdp_param_groups
            self.assertFalse(block0_group.reshard_after_backward)
            self.assertEqual(block1.get_fsdp_policy(), policies["body.1"])
            self.assertEqual(model.get_fsdp_policy(), root_policy)
        self.assertEqual(fsdp_policies(model), policies)
        self._assert_same_snapshot(snapshot, _snapshot(model), "keyword scope")

    def test_fsdp_policy_scope_policy_argument(self):
        """``policy=`` is applied as a whole, then the keywords on top."""
        (
            model, block0, block1, block0_policy, state_ctx, policies, root_policy, snapshot
        ) = self._scope_setup()
        # policy=: applied as a whole, then the keywords on top
        given = FSDPPolicy(requires_gradient_sync=False, reshard_after_forward=True)
        with block0.fsdp_policy(
            given, reshard_after_backward=False, recurse=False
        ) as applied:
            expected = dataclasses.replace(given, reshard_after_backward=False)
            self.assertEqual(applied, expected)
            self.assertEqual(block0.get_fsdp_policy(), expected)
            group = block0._get_fsdp_state()._fsdp_param_groups[0]
            self.assertIs(group.post_forward_mesh_info, group.mesh_info)
            self.assertTrue(group.all_reduce_grads)  # from ``given``
        self._assert_same_snapshot(snapshot, _snapshot(model), "policy= scope")

    def test_fsdp_policy_scope_recurse(self):
        """``recurse=True`` changes the given fields of every module and keeps each module's other fields."""
        (
            model, block0, block1, block0_policy, state_ctx, policies, root_policy, snapshot
        ) = self._scope_setup()
        # recurse=True: every module keeps its own other fields
        with model.fsdp_policy(recurse=True, requires_gradient_sync=False) as applied:
            self.assertEqual(
                applied, dataclasses.replace(root_policy, requires_gradient_sync=False)
            )
            for name, policy in fsdp_policies(model).items():
                self.assertEqual(
                    policy,
                    dataclasses.replace(policies[name], requires_gradient_sync=False),
                    name,
                )
            for group in fsdp_param_groups(model):
                self.assertFalse(group.reduce_grads)
            # Without recurse, only the root would have changed
        with model.fsdp_policy(requires_gradient_sync=False, recurse=False):
            self.assertEqual(block1.get_fsdp_policy(), policies["body.1"])
            self.assertEqual(model.norm.get_fsdp_policy(), policies["norm"])
        self._assert_same_snapshot(snapshot, _snapshot(model), "recurse scope")

    def test_fsdp_policy_scope_is_last_backward(self):
        """
        ``is_last_backward`` is root-wide: a scope that sets it restores it,
        also when the body changes it; a scope that does not set it leaves
        the body's change.
        """
        (
            model, block0, block1, block0_policy, state_ctx, policies, root_policy, snapshot
        ) = self._scope_setup()
        # is_last_backward: root-wide, restored; the body may change it too
        with block1.fsdp_policy(is_last_backward=False, recurse=False) as applied:
            self.assertEqual(applied, policies["body.1"])
            self.assertFalse(state_ctx.is_last_backward)
            model.set_is_last_backward(False)
        self.assertTrue(state_ctx.is_last_backward)
        with model.fsdp_policy(recurse=False):
            model.set_is_last_backward(False)
        self.assertFalse(state_ctx.is_last_backward)
        with model.fsdp_policy(is_last_backward=True, recurse=False):
            self.assertTrue(state_ctx.is_last_backward)
        self.assertFalse(state_ctx.is_last_backward)
        model.set_is_last_backward(True)
        self._assert_same_snapshot(snapshot, _snapshot(model), "is_last_backward")

    def test_fsdp_policy_scope_nesting(self):
        """Nested scopes apply on top of each other and restore in order."""
        (
            model, block0, block1, block0_policy, state_ctx, policies, root_policy, snapshot
        ) = self._scope_setup()
        # Nesting
        with model.fsdp_policy(recurse=True, requires_gradient_sync=False):
            with block0.fsdp_policy(
                reshard_after_forward=True, requires_gradient_sync=True, recurse=False
            ) as inner:
                self.assertEqual(
                    inner,
                    dataclasses.replace(block0_policy, reshard_after_forward=True),
                )
                self.assertFalse(block1.get_fsdp_policy().requires_gradient_sync)
                with model.fsdp_policy(recurse=True, reshard_after_backward=False):
                    self.assertEqual(
                        block0.get_fsdp_policy(),
                        dataclasses.replace(inner, reshard_after_backward=False),
                    )
                self.assertEqual(block0.get_fsdp_policy(), inner)
            self.assertEqual(
                block0.get_fsdp_policy(),
                dataclasses.replace(block0_policy, requires_gradient_sync=False),
            )
        self.assertEqual(fsdp_policies(model), policies)
        self._assert_same_snapshot(snapshot, _snapshot(model), "nesting")

    def test_fsdp_policy_scope_restores_only_what_it_changed(self):
        """
        A scope restores the fields it changed, on the modules it changed them
        on; changes that the body makes to other fields or modules, and
        ``is_last_backward`` unless the scope set it, are the caller's. The
        policies in force then train like the same policies set without a
        scope. Revision 4 restored every field of every touched module and
        ``is_last_backward`` after every scope: after
        ``with lm_head.fsdp_policy(reshard_after_backward=False,
        recurse=False): root.set_is_last_backward(False)`` it read ``True``.
        """
        (
            model, block0, block1, block0_policy, state_ctx, policies, root_policy, snapshot
        ) = self._scope_setup()
        head = model.lm_head
        # A leaf scope that does not set ``is_last_backward``
        with head.fsdp_policy(reshard_after_backward=False, recurse=False):
            model.set_is_last_backward(False)
        self.assertFalse(state_ctx.is_last_backward)
        self.assertEqual(fsdp_policies(model), policies)
        model.set_is_last_backward(True)
        # ``requires_all_reduce=False`` changes block1, the head and the root,
        # not block0 (already ``False``); the body's changes to other fields,
        # and to block0's ``requires_all_reduce``, stay
        with model.fsdp_policy(requires_all_reduce=False, recurse=True):
            block0.set_fsdp_policy(
                dataclasses.replace(block0_policy, requires_all_reduce=True),
                recurse=False,
            )
            block1.set_fsdp_policy(
                FSDPPolicy(requires_all_reduce=False, reshard_after_forward=False),
                recurse=False,
            )
        expected = {
            **policies,
            "body.0": dataclasses.replace(block0_policy, requires_all_reduce=True),
            "body.1": dataclasses.replace(
                policies["body.1"], reshard_after_forward=False
            ),
        }
        self.assertEqual(fsdp_policies(model), expected)
        self.assertTrue(state_ctx.is_last_backward)
        # The policies in force are the caller's: a step reduces and reshards
        # like a copy given the same policies without a scope
        torch.manual_seed(0)
        copy_model = _shard(Model(), group_head=True)
        for name, module in copy_model.named_modules():
            if isinstance(module, FSDPModule):
                module.set_fsdp_policy(expected[name], recurse=False)
        self.assertEqual(fsdp_policies(copy_model), expected)
        inp = torch.randn(4, DIM, generator=torch.Generator().manual_seed(self.rank))
        model.zero_grad(set_to_none=True)
        for m in (model, copy_model):
            self._train_step(m, inp)
        for (name, param), copy_param in zip(
            model.named_parameters(), copy_model.parameters(), strict=True
        ):
            self.assertEqual(
                param.grad.full_tensor(), copy_param.grad.full_tensor(), msg=name
            )
        # block1 (``reshard_after_forward=False``) keeps its parameters
        # unsharded after forward in both
        for m in (model, copy_model):
            (group,) = m.body[1]._get_fsdp_state()._fsdp_param_groups
            self.assertIsNone(group.post_forward_mesh_info)

    def test_fsdp_policy_scope_restores_on_exception(self):
        """On an exception every touched module is restored and the exception propagates."""
        (
            model, block0, block1, block0_policy, state_ctx, policies, root_policy, snapshot
        ) = self._scope_setup()
        # Restore on exception: every touched module, exception propagates
        class _Boom(Exception):
            pass

        with self.assertRaises(_Boom):
            with model.fsdp_policy(
                FSDPPolicy(
                    requires_gradient_sync=False,
                    requires_all_reduce=False,
                    reshard_after_forward=True,
                    reshard_after_backward=False,
                ),
                recurse=True,
                is_last_backward=False,
            ):
                with block0.fsdp_policy(reshard_after_forward=False, recurse=False):
                    # Setters inside the body are undone too where the scopes
                    # changed the field (``requires_all_reduce`` of block0,
                    # which the scopes kept ``False``, is the body's)
                    model.set_requires_gradient_sync(True)
                    block1.set_fsdp_policy(
                        FSDPPolicy(reshard_after_forward=False), recurse=False
                    )
                    raise _Boom
        self.assertTrue(state_ctx.is_last_backward)
        self.assertEqual(
            fsdp_policies(model),
            {**policies, "body.0": dataclasses.replace(block0_policy, requires_all_reduce=True)},
        )
        block0.set_fsdp_policy(block0_policy, recurse=False)
        self._assert_same_snapshot(snapshot, _snapshot(model), "exception")

    def test_fsdp_policy_scope_around_lazy_init(self):
        """A scope around the first iteration restores the automatic choice, resolved for the root."""
        # A scope around the first iteration (lazy init inside the body)
        # restores the automatic choice, now resolved for the root
        torch.manual_seed(0)
        fresh = _shard(Model())
        with fresh.fsdp_policy(
            recurse=True, requires_gradient_sync=False, reshard_after_forward=True
        ):
            _loss(fresh(torch.randn(4, DIM))).backward()
        for name, policy in fsdp_policies(fresh).items():
            self.assertEqual(policy, FSDPPolicy(), name)
        for group in fresh._get_fsdp_state()._fsdp_param_groups:
            self.assertIsNone(group.post_forward_mesh_info)
        for block in fresh.body:
            (group,) = block._get_fsdp_state()._fsdp_param_groups
            self.assertIs(group.post_forward_mesh_info, group.mesh_info)

    def test_fsdp_policy_scope_collectives(self):
        """The policy in force inside a scope is what FSDP does: no reduce-scatter under no-sync, one per group afterwards."""
        (
            model, block0, block1, block0_policy, state_ctx, policies, root_policy, snapshot
        ) = self._scope_setup()
        # The policy in force inside a scope is what FSDP does: no
        # reduce-scatter under no-sync, one per group afterwards
        counter = CollectiveCounter()
        num_groups = len(fsdp_param_groups(model))
        inp = torch.randn(4, DIM)
        with model.fsdp_policy(recurse=True, requires_gradient_sync=False):
            with counter.count():
                self._train_step(model, inp)
        self.assertEqual(counter["reduce_scatter"], 0)
        counter.reset()
        with counter.count():
            self._train_step(model, inp)
        self.assertEqual(counter["reduce_scatter"], num_groups)
        self._assert_same_snapshot(snapshot, _snapshot(model), "after training")

    def test_is_last_backward_scope_before_lazy_init(self):
        """
        ``is_last_backward`` is root-wide. A scope that sets it on the root
        before the first forward (lazy init) is in force for that forward and
        restored on exit. A scope that sets it on a non-root module when the
        root's first forward runs inside it would be lost (lazy init replaces
        that module's state context), so that forward raises ``RuntimeError``
        before lazy init changes anything, and the next forward after the
        scope trains normally. A non-root scope that does not set it keeps
        the root's value. Revision 2 carried such scopes over with a counter
        and a sorted merge.
        """
        local_inputs = _local_inputs(self.rank, 1, seed=5)
        all_inputs = _all_inputs(local_inputs)
        for root_value in (True, False):
            torch.manual_seed(0)
            model = _shard(Model())
            root_ctx = model._get_fsdp_state()._state_ctx
            model.set_is_last_backward(root_value)
            with model.fsdp_policy(is_last_backward=not root_value, recurse=False):
                model(local_inputs[0])
                self.assertIs(model.body[0]._get_fsdp_state()._state_ctx, root_ctx)
                self.assertEqual(root_ctx.is_last_backward, not root_value)
            self.assertEqual(root_ctx.is_last_backward, root_value)
            model.reset_iter_state()

            torch.manual_seed(0)
            model = Model()
            ref_model = copy.deepcopy(model)
            _shard(model)
            root_ctx = model._get_fsdp_state()._state_ctx
            model.set_is_last_backward(root_value)
            with model.body[0].fsdp_policy(is_last_backward=False, recurse=False):
                with self.assertRaisesRegex(
                    RuntimeError, "is_last_backward.*not the root FSDP module"
                ):
                    model(local_inputs[0])
            for module in _fsdp_modules(model):
                self.assertIsNone(module._get_fsdp_state()._is_root)
            self.assertEqual(root_ctx.is_last_backward, root_value)
            model.set_is_last_backward(True)
            with model.body[1].fsdp_policy(reshard_after_forward=False, recurse=False):
                _loss(model(local_inputs[0])).backward()
                self.assertTrue(root_ctx.is_last_backward)
            ref_inp = torch.cat([inputs[0] for inputs in all_inputs])
            _loss(ref_model(ref_inp)).backward()
            # Sharded gradients equal to the full batch's: reduced, none pending
            for (name, param), ref_param in zip(
                model.named_parameters(), ref_model.parameters()
            ):
                self.assertEqual(param.grad.full_tensor(), ref_param.grad, msg=name)

    def test_recurse_is_required(self):
        """
        ``recurse`` has no default for ``set_fsdp_policy`` and ``fsdp_policy``:
        omitting it raises ``TypeError`` before anything changes, so moving
        from ``set_requires_gradient_sync(False)`` (``recurse=True`` by
        default) to the value API cannot silently keep reducing the children.
        With ``recurse=True`` the scope reduces nothing, like the setter.
        Revision 2 defaulted to ``recurse=False``: 3 reduce-scatters instead
        of 0.
        """
        torch.manual_seed(0)
        model = _shard(Model())
        before = _snapshot(model)
        with self.assertRaisesRegex(TypeError, "recurse"):
            model.set_fsdp_policy(FSDPPolicy())
        with self.assertRaisesRegex(TypeError, "recurse"):
            with model.fsdp_policy(requires_gradient_sync=False):
                pass
        self._assert_same_snapshot(before, _snapshot(model), "missing recurse")
        counter = CollectiveCounter()
        inp = torch.randn(4, DIM)
        with model.fsdp_policy(requires_gradient_sync=False, recurse=True):
            with counter.count():
                self._train_step(model, inp)
        self.assertEqual(counter["reduce_scatter"], 0)
        model.set_requires_gradient_sync(False)
        counter.reset()
        with counter.count():
            self._train_step(model, inp)
        self.assertEqual(counter["reduce_scatter"], 0)
        model.set_requires_gradient_sync(True)

    def test_recurse_and_int_1(self):
        """
        ``recurse`` must be a ``bool`` (``"no"`` used to recurse silently),
        checked before anything changes. An ``int`` ``reshard_after_forward``
        of ``1`` gives the warning ``fully_shard`` gives and reads back as
        ``False``.
        """
        torch.manual_seed(0)
        model = _shard(Model())
        before = _snapshot(model)
        for call in (
            lambda: model.set_fsdp_policy(FSDPPolicy(), recurse="no"),
            lambda: model.fsdp_policy(
                requires_gradient_sync=False, recurse=1
            ).__enter__(),
        ):
            with self.assertRaisesRegex(TypeError, "recurse must be a bool"):
                call()
        self._assert_same_snapshot(before, _snapshot(model), "recurse")
        with self.assertLogs("torch.distributed.fsdp.fully_shard", "WARNING") as logs:
            model.set_fsdp_policy(FSDPPolicy(reshard_after_forward=1), recurse=True)
        self.assertIn("reshard_after_forward=1 (int)", "\n".join(logs.output))
        for name, policy in fsdp_policies(model).items():
            self.assertEqual(policy, FSDPPolicy(reshard_after_forward=False), name)
        for group in fsdp_param_groups(model):
            self.assertIsNone(group.post_forward_mesh_info)

    def test_reshard_keeps_unreduced_gradients(self):
        """
        The documented contract of ``FSDPModule.reshard``: resharding every
        module between accumulating backwards (no gradient sync, parameters
        kept unsharded after backward) keeps the unreduced gradients, and the
        final, synchronized backward reduces them once with its own; over two
        SGD steps, gradients and parameters match the reference.
        """
        torch.manual_seed(0)
        model = Model()
        ref_model = copy.deepcopy(model)
        _shard(model)
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        ref_optim = torch.optim.SGD(ref_model.parameters(), lr=0.1)
        groups = fsdp_param_groups(model)
        counter = CollectiveCounter()
        for step in range(2):
            local_inputs = _local_inputs(self.rank, NUM_MICROBATCHES, seed=step)
            all_inputs = _all_inputs(local_inputs)
            counter.reset()
            with counter.count():
                for mb, inp in enumerate(local_inputs):
                    if mb < NUM_MICROBATCHES - 1:
                        with model.fsdp_policy(
                            recurse=True,
                            requires_gradient_sync=False,
                            reshard_after_backward=False,
                        ):
                            _loss(model(inp)).backward()
                        self.assertEqual(counter["reduce_scatter"], 0)
                        self.assertTrue(all(g.is_unsharded for g in groups))
                        for module in _fsdp_modules(model):
                            module.reshard()
                        self.assertTrue(all(g.is_sharded for g in groups))
                    else:
                        _loss(model(inp)).backward()
            self.assertEqual(counter["reduce_scatter"], len(groups))
            for mb in range(NUM_MICROBATCHES):
                ref_inp = torch.cat([inputs[mb] for inputs in all_inputs])
                _loss(ref_model(ref_inp)).backward()
            self._check_grads_and_step(model, ref_model, optim, ref_optim)
        for param, ref_param in zip(model.parameters(), ref_model.parameters()):
            self.assertEqual(param.full_tensor(), ref_param)

    def test_default_behavior_unchanged(self):
        """
        Without the new API, training matches a single-process reference with
        the collective counts FSDP has always had.
        """
        self.run_subtests(
            {"accumulate": [False, True]}, self._test_default_behavior_unchanged
        )

    def _test_default_behavior_unchanged(self, accumulate: bool):
        torch.manual_seed(0)
        model = Model()
        ref_model = copy.deepcopy(model)
        _shard(model)
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        ref_optim = torch.optim.SGD(ref_model.parameters(), lr=0.1)
        num_groups = len(fsdp_param_groups(model))
        self.assertEqual(num_groups, 3)  # two blocks and the root
        num_microbatches = NUM_MICROBATCHES if accumulate else 1
        counter = CollectiveCounter()
        for step in range(3):
            local = _local_inputs(self.rank, num_microbatches, seed=step)
            all_inputs = _all_inputs(local)
            for mb in range(num_microbatches):
                is_last = mb == num_microbatches - 1
                if accumulate:
                    model.set_requires_gradient_sync(is_last)
                counter.reset()
                with counter.count():
                    self._train_step(model, local[mb])
                # Forward all-gathers every group; backward all-gathers every
                # group but the root, which keeps its parameters after forward
                self.assertEqual(counter["all_gather"], 2 * num_groups - 1)
                self.assertEqual(
                    counter["reduce_scatter"], num_groups if is_last else 0
                )
                self.assertEqual(counter["all_reduce"], 0)
                ref_inp = torch.cat([inputs[mb] for inputs in all_inputs])
                _loss(ref_model(ref_inp)).backward()
            for (name, param), ref_param in zip(
                model.named_parameters(), ref_model.parameters()
            ):
                self.assertEqual(
                    param.grad.full_tensor(),
                    ref_param.grad,
                    rtol=1e-5,
                    atol=1e-5,
                    msg=name,
                )
            optim.step()
            ref_optim.step()
            optim.zero_grad()
            ref_optim.zero_grad()
            for (name, param), ref_param in zip(
                model.named_parameters(), ref_model.parameters()
            ):
                self.assertEqual(
                    param.full_tensor(), ref_param, rtol=1e-5, atol=1e-5, msg=name
                )
        # The API was never used and the policy is still the default
        for name, policy in fsdp_policies(model).items():
            self.assertEqual(policy, FSDPPolicy(), name)


# ---------------------------------------------------------------------------
# World size 4: int reshard_after_forward, all-or-nothing errors, HSDP
# ---------------------------------------------------------------------------
class TestFullyShardPolicyWorld4(_PolicyTestBase):
    @property
    def world_size(self) -> int:
        return 4

    def test_round_trip_int(self):
        """
        ``reshard_after_forward`` as an int (2 on a 1-D mesh of 4): exact round
        trip before and after lazy init, and no device mesh or process group
        is created by restoring, including int -> False -> int.
        """
        self.run_subtests(
            {"root_reshard_after_forward": [None, 2]}, self._test_round_trip_int
        )

    def _test_round_trip_int(self, root_reshard_after_forward):
        mesh = init_device_mesh("cpu", (4,))
        torch.manual_seed(0)
        model = Model()
        ref_model = copy.deepcopy(model)
        with _count_mesh_and_group_creation() as created:
            _shard(
                model,
                mesh=mesh,
                reshard_after_forward=2,
                root_reshard_after_forward=root_reshard_after_forward,
            )
        # Positive control for the counter: fully_shard made a post-forward
        # mesh per block (and for the root when it is given the int)
        self.assertGreaterEqual(created["mesh"], 2)
        block0, block1 = model.body
        int_policy = FSDPPolicy(reshard_after_forward=2)
        root_policy = FSDPPolicy(reshard_after_forward=root_reshard_after_forward)
        self.assertEqual(block0.get_fsdp_policy(), int_policy)
        self.assertEqual(model.get_fsdp_policy(), root_policy)
        (group0,) = block0._get_fsdp_state()._fsdp_param_groups
        (root_group,) = model._get_fsdp_state()._fsdp_param_groups
        post_forward = group0.post_forward_mesh_info
        self.assertIsNot(post_forward, group0.mesh_info)
        self.assertEqual(post_forward.shard_mesh_size, 2)

        def round_trip(where: str) -> None:
            before = _snapshot(model)
            with _count_mesh_and_group_creation() as created:
                for module in _fsdp_modules(model):
                    module.set_fsdp_policy(module.get_fsdp_policy(), recurse=False)
                if root_reshard_after_forward == 2:
                    # Uniform policy: recurse=True on the root is a round trip
                    model.set_fsdp_policy(model.get_fsdp_policy(), recurse=True)
                    with model.fsdp_policy(recurse=True) as applied:
                        self.assertEqual(applied, int_policy)
                # int -> False -> int reuses the cached post-forward mesh
                block0.set_fsdp_policy(
                    FSDPPolicy(reshard_after_forward=False), recurse=False
                )
                self.assertIsNone(group0.post_forward_mesh_info)
                self.assertEqual(
                    block0.get_fsdp_policy(), FSDPPolicy(reshard_after_forward=False)
                )
                block0.set_fsdp_policy(int_policy, recurse=False)
                self.assertIs(group0.post_forward_mesh_info, post_forward)
                with block1.fsdp_policy(reshard_after_forward=True, recurse=False):
                    pass
                with block1.fsdp_policy(reshard_after_forward=None, recurse=False):
                    pass
                with model.fsdp_policy(recurse=True, reshard_after_forward=False):
                    pass
            self.assertEqual(created["mesh"], 0, where)
            self.assertEqual(created["group"], 0, where)
            self.assertEqual(block0.get_fsdp_policy(), int_policy)
            self.assertIs(group0.post_forward_mesh_info, post_forward)
            self._assert_same_snapshot(before, _snapshot(model), where)

        round_trip("before lazy init")
        counter = CollectiveCounter()
        inp = torch.randn(4, DIM)
        with counter.count():
            _loss(model(inp)).backward()
        # Forward all-gathers the three groups; backward re-gathers the blocks
        # (from their 2-way post-forward shards) and the root only if it was
        # given the int (automatic keeps the root's parameters)
        self.assertEqual(
            counter["all_gather"], 6 if root_reshard_after_forward == 2 else 5
        )
        if root_reshard_after_forward is None:
            self.assertIsNone(root_group.post_forward_mesh_info)
        else:
            self.assertEqual(root_group.post_forward_mesh_info.shard_mesh_size, 2)
        round_trip("after lazy init")
        self.assertEqual(model.get_fsdp_policy(), root_policy)

        if root_reshard_after_forward is None:
            # An int the root was not built with is refused: making its
            # post-forward mesh would be a collective
            before = _snapshot(model)
            with _count_mesh_and_group_creation() as created:
                with self.assertRaisesRegex(ValueError, "fully_shard"):
                    model.set_fsdp_policy(int_policy, recurse=False)
                with self.assertRaisesRegex(ValueError, "fully_shard"):
                    with model.fsdp_policy(reshard_after_forward=2, recurse=False):
                        pass
            self.assertEqual(created["mesh"], 0)
            self.assertEqual(created["group"], 0)
            self._assert_same_snapshot(before, _snapshot(model), "refused int")
            self.assertIsNone(root_group.post_forward_mesh_info)

        # Normalisation: the shard mesh size reads True, 1 reads False
        with block0.fsdp_policy(reshard_after_forward=4, recurse=False) as applied:
            self.assertEqual(applied, FSDPPolicy(reshard_after_forward=True))
            self.assertIs(group0.post_forward_mesh_info, group0.mesh_info)
        with block0.fsdp_policy(reshard_after_forward=1, recurse=False) as applied:
            self.assertEqual(applied, FSDPPolicy(reshard_after_forward=False))
            self.assertIsNone(group0.post_forward_mesh_info)
        self.assertIs(group0.post_forward_mesh_info, post_forward)

        # After all that, a second iteration behaves as the first and the
        # accumulated gradients match the reference
        inp2 = torch.randn(4, DIM)
        counter.reset()
        with counter.count():
            _loss(model(inp2)).backward()
        self.assertEqual(
            counter["all_gather"], 6 if root_reshard_after_forward == 2 else 5
        )
        self.assertEqual(counter["reduce_scatter"], 3)
        all_inputs = _all_inputs([inp, inp2])
        for mb in range(2):
            ref_inp = torch.cat([inputs[mb] for inputs in all_inputs])
            _loss(ref_model(ref_inp)).backward()
        for (name, param), ref_param in zip(
            model.named_parameters(), ref_model.parameters()
        ):
            self.assertEqual(param.grad.full_tensor(), ref_param.grad, msg=name)

    def test_runtime_int_refused_unless_built_with(self):
        """
        An ``int`` ``reshard_after_forward`` that a module was not built with
        raises ``ValueError`` pointing to ``fully_shard`` before anything
        changes, and creates no device mesh or process group. Revision 1
        accepted it, creating a mesh, and the next forward raised
        ``AssertionError`` since the ``FSDPParam``s kept their sharding.
        """
        mesh = init_device_mesh("cpu", (4,))
        expected = r"fully_shard\(\.\.\., reshard_after_forward=2\)"
        for built_with in (True, False, None):
            torch.manual_seed(0)
            model = _shard(Model(), mesh=mesh, reshard_after_forward=built_with)
            block0 = model.body[0]
            for lazy_init in (False, True):
                where = f"built_with={built_with}, lazy_init={lazy_init}"
                if lazy_init:
                    _loss(model(torch.randn(4, DIM))).backward()
                before = _snapshot(model)
                policies = fsdp_policies(model)
                body_ran = []
                with _count_mesh_and_group_creation() as created:
                    with self.assertRaisesRegex(ValueError, expected, msg=where):
                        block0.set_fsdp_policy(
                            dataclasses.replace(
                                block0.get_fsdp_policy(), reshard_after_forward=2
                            ),
                            recurse=False,
                        )
                    with self.assertRaisesRegex(ValueError, expected, msg=where):
                        with model.fsdp_policy(recurse=True, reshard_after_forward=2):
                            body_ran.append(where)
                self.assertEqual(created["mesh"], 0, where)
                self.assertEqual(created["group"], 0, where)
                self.assertEqual(body_ran, [], where)
                self.assertEqual(fsdp_policies(model), policies, where)
                self._assert_same_snapshot(before, _snapshot(model), where)
            # Training runs on after the refusals
            _loss(model(torch.randn(4, DIM))).backward()

    def test_runtime_int_refused_on_spmd_mesh(self):
        """
        ``fully_shard`` does not accept an ``int`` ``reshard_after_forward``
        on an SPMD mesh (``dp_mesh_dims``); applying a policy follows the same
        rule with ``ValueError``, creating no mesh and changing nothing.
        Revision 1 accepted it and created a mesh.
        """
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
        dp_mesh_dims = DataParallelMeshDims(shard="dp")
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(DIM, DIM) for _ in range(3)])
        for module in model:
            for name, param in list(module.named_parameters()):
                replicated = distribute_tensor(param.detach(), mesh, [Replicate()])
                setattr(module, name, nn.Parameter(replicated))
        # ``fully_shard``'s rule, on a module left out of the model
        with self.assertRaisesRegex(NotImplementedError, "SPMD mesh"):
            fully_shard(
                model[2], mesh=mesh, dp_mesh_dims=dp_mesh_dims, reshard_after_forward=2
            )
        model = model[:2]
        fully_shard(model[0], mesh=mesh, dp_mesh_dims=dp_mesh_dims)
        fully_shard(model, mesh=mesh, dp_mesh_dims=dp_mesh_dims)
        for lazy_init in (False, True):
            if lazy_init:
                inp = DTensor.from_local(torch.randn(4, DIM), mesh, [Replicate()])
                model(inp).sum().backward()
            before = _snapshot(model)
            with _count_mesh_and_group_creation() as created:
                for value in (2, 4):
                    with self.assertRaisesRegex(ValueError, "SPMD mesh"):
                        model[0].set_fsdp_policy(
                            FSDPPolicy(reshard_after_forward=value), recurse=False
                        )
                    with self.assertRaisesRegex(ValueError, "SPMD mesh"):
                        with model.fsdp_policy(
                            recurse=True, reshard_after_forward=value
                        ):
                            pass
            self.assertEqual(created["mesh"], 0)
            self.assertEqual(created["group"], 0)
            self._assert_same_snapshot(before, _snapshot(model), f"{lazy_init=}")

    def test_runtime_int_end_to_end(self):
        """
        Blocks built with ``reshard_after_forward=2`` on a mesh of 4 switch at
        runtime between 2, ``True``, ``False`` and ``None``, before forward and
        between forward and backward: every ``FSDPParam`` follows its group,
        the parameters after forward have the sharding of the policy in force,
        no mesh or group is created, and several SGD steps match a
        single-process reference.
        """
        mesh = init_device_mesh("cpu", (4,))
        torch.manual_seed(0)
        model = Model()
        ref_model = copy.deepcopy(model)
        _shard(
            model, mesh=mesh, reshard_after_forward=2, root_reshard_after_forward=None
        )
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        ref_optim = torch.optim.SGD(ref_model.parameters(), lr=0.1)
        blocks = list(model.body)
        groups = [block._get_fsdp_state()._fsdp_param_groups[0] for block in blocks]
        int_mesh_infos = [group.post_forward_mesh_info for group in groups]
        # (policy in force for the forward, policy switched to before backward)
        schedule = [(2, 2), (True, 2), (2, True), (False, 2), (2, False), (2, None)]
        local_inputs = _local_inputs(self.rank, len(schedule), seed=3)
        all_inputs = _all_inputs(local_inputs)
        counter = CollectiveCounter()
        for step, (forward_raf, backward_raf) in enumerate(schedule):
            where = f"step {step}: {forward_raf} then {backward_raf}"
            counter.reset()
            with _count_mesh_and_group_creation() as created, counter.count():
                for block in blocks:
                    block.set_fsdp_policy(
                        FSDPPolicy(reshard_after_forward=forward_raf), recurse=False
                    )
                out = model(local_inputs[step])
                for block, group, int_mesh_info in zip(blocks, groups, int_mesh_infos):
                    weight = block.lin.weight
                    if forward_raf is False:
                        self.assertTrue(group.is_unsharded, where)
                        self.assertEqual(weight.shape, (DIM, DIM), where)
                    elif forward_raf == 2:
                        self.assertTrue(group.is_sharded_post_forward, where)
                        self.assertIs(group.post_forward_mesh_info, int_mesh_info)
                        self.assertEqual(weight.device_mesh, int_mesh_info.mesh)
                        self.assertEqual(weight.to_local().shape, (DIM // 2, DIM))
                    else:
                        self.assertTrue(group.is_sharded, where)
                        self.assertEqual(weight.to_local().shape, (DIM // 4, DIM))
                    for fsdp_param in group.fsdp_params:
                        self.assertIs(
                            fsdp_param.post_forward_mesh_info,
                            group.post_forward_mesh_info,
                            where,
                        )
                for block in blocks:
                    block.set_fsdp_policy(
                        FSDPPolicy(reshard_after_forward=backward_raf), recurse=False
                    )
                for group in groups:
                    for fsdp_param in group.fsdp_params:
                        self.assertIs(
                            fsdp_param.post_forward_mesh_info,
                            group.post_forward_mesh_info,
                            where,
                        )
                _loss(out).backward()
            self.assertEqual(created["mesh"], 0, where)
            self.assertEqual(created["group"], 0, where)
            # Forward gathers the blocks and the root; backward re-gathers the
            # blocks that forward resharded (the root keeps its parameters)
            num_resharded = 0 if forward_raf is False else len(blocks)
            self.assertEqual(counter["all_gather"], 3 + num_resharded, where)
            self.assertEqual(counter["reduce_scatter"], 3, where)
            ref_inp = torch.cat([inputs[step] for inputs in all_inputs])
            _loss(ref_model(ref_inp)).backward()
            self._check_grads_and_step(model, ref_model, optim, ref_optim, where)
        for param, ref_param in zip(model.parameters(), ref_model.parameters()):
            self.assertEqual(param.full_tensor(), ref_param)

    def test_fully_shard_int_equal_to_mesh_size_reads_true(self):
        mesh = init_device_mesh("cpu", (4,))
        torch.manual_seed(0)
        model = _shard(Model(), mesh=mesh, reshard_after_forward=4, shard_body=True)
        for name, policy in fsdp_policies(model).items():
            self.assertEqual(policy, FSDPPolicy(reshard_after_forward=True), name)
        for group in fsdp_param_groups(model):
            self.assertIs(group.post_forward_mesh_info, group.mesh_info)

    def test_invalid_values_change_nothing(self):
        """
        Invalid values raise before anything changes, on every module the call
        would touch, for ``set_fsdp_policy`` and ``fsdp_policy``.
        """
        mesh_1d = init_device_mesh("cpu", (4,))
        mesh_2d = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        torch.manual_seed(0)
        model = Model(num_blocks=3)
        # The last block shards over 2 (HSDP): 4 is valid for every other
        # module (reads True) but not for it, and it is visited last
        for block in model.body[:2]:
            fully_shard(block, mesh=mesh_1d)
        fully_shard(model.body[2], mesh=mesh_2d)
        fully_shard(model, mesh=mesh_1d)
        for lazy_init in (False, True):
            if lazy_init:
                _loss(model(torch.randn(4, DIM))).backward()
            where = f"lazy_init={lazy_init}"
            policies = fsdp_policies(model)
            snapshot = _snapshot(model)
            state_ctx = model._get_fsdp_state()._state_ctx
            is_last_backward = state_ctx.is_last_backward
            body_ran = []

            def check_unchanged(what: str) -> None:
                self.assertEqual(fsdp_policies(model), policies, f"{where}: {what}")
                self._assert_same_snapshot(
                    snapshot, _snapshot(model), f"{where}: {what}"
                )
                self.assertEqual(state_ctx.is_last_backward, is_last_backward)
                self.assertEqual(body_ran, [], what)

            for bad in (3, 4, 8):
                with self.assertRaisesRegex(ValueError, "reshard_after_forward|factor"):
                    model.set_fsdp_policy(
                        FSDPPolicy(
                            requires_gradient_sync=False, reshard_after_forward=bad
                        ),
                        recurse=True,
                    )
                check_unchanged(f"set_fsdp_policy({bad}, recurse=True)")
                with self.assertRaisesRegex(ValueError, "reshard_after_forward|factor"):
                    with model.fsdp_policy(
                        recurse=True,
                        requires_gradient_sync=False,
                        reshard_after_forward=bad,
                        is_last_backward=not is_last_backward,
                    ):
                        body_ran.append(bad)
                check_unchanged(f"fsdp_policy(reshard_after_forward={bad})")
                with self.assertRaisesRegex(ValueError, "reshard_after_forward|factor"):
                    with model.fsdp_policy(
                        FSDPPolicy(
                            requires_all_reduce=False, reshard_after_forward=bad
                        ),
                        recurse=True,
                    ):
                        body_ran.append(bad)
                check_unchanged(f"fsdp_policy(policy={bad})")
            # Valid for the 4-way modules alone
            with model.fsdp_policy(recurse=False, reshard_after_forward=4) as applied:
                self.assertEqual(applied.reshard_after_forward, True)
            with self.assertRaises(ValueError):
                model.body[2].set_fsdp_policy(
                    FSDPPolicy(reshard_after_forward=4), recurse=False
                )
            check_unchanged("valid then invalid")

            # Type errors
            for kwargs in (
                {"requires_gradient_sync": 1},
                {"requires_all_reduce": None},
                {"reshard_after_backward": "no"},
                {"reshard_after_forward": "2"},
                {"is_last_backward": 0},
                {"policy": {"requires_gradient_sync": False}},
            ):
                with self.assertRaises(TypeError, msg=str(kwargs)):
                    with model.fsdp_policy(recurse=True, **kwargs):
                        body_ran.append(kwargs)
                check_unchanged(f"fsdp_policy({kwargs})")
            with self.assertRaises(ValueError):
                with model.fsdp_policy(recurse=True, reshard_after_forward=0):
                    body_ran.append(0)
            check_unchanged("fsdp_policy(reshard_after_forward=0)")
            for bad_policy in (None, True, dataclasses.asdict(FSDPPolicy())):
                with self.assertRaises(TypeError):
                    model.set_fsdp_policy(
                        bad_policy,  # type: ignore[arg-type]
                        recurse=True,
                    )
                check_unchanged(f"set_fsdp_policy({bad_policy!r})")

    def test_disagreeing_groups(self):
        """
        A state whose parameter groups disagree (only through private fields)
        has no single policy: ``get_fsdp_policy`` raises ``ValueError``.
        """
        mesh_1d = init_device_mesh("cpu", (4,))
        mesh_2d = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        head_mesh_info = FSDPMeshInfo(mesh_2d["shard"], shard_mesh_dim=0)

        def shard_placement_fn(param: nn.Parameter):
            # Per-parameter mesh: lm_head's parameters get their own group
            if any(param is p for p in model.lm_head.parameters()):
                return ShardPlacementResult(Shard(0), head_mesh_info)
            return None

        torch.manual_seed(0)
        model = Model()
        fully_shard(
            model,
            mesh=mesh_1d,
            reshard_after_forward=True,
            shard_placement_fn=shard_placement_fn,
        )
        groups = model._get_fsdp_state()._fsdp_param_groups
        self.assertEqual(len(groups), 2)
        policy = FSDPPolicy(reshard_after_forward=True)
        self.assertEqual(model.get_fsdp_policy(), policy)
        for field, value in (
            ("reduce_grads", False),
            ("all_reduce_grads", False),
            ("reshard_after_backward", False),
            ("post_forward_mesh_info", None),
        ):
            original = getattr(groups[1], field)
            setattr(groups[1], field, value)
            with self.assertRaisesRegex(ValueError, "different policies"):
                model.get_fsdp_policy()
            # Entering a scope reads the policy, so it raises before changing
            with self.assertRaisesRegex(ValueError, "different policies"):
                with model.fsdp_policy(requires_gradient_sync=False, recurse=False):
                    pass
            self.assertEqual(getattr(groups[1], field), value)
            self.assertTrue(groups[0].reduce_grads)
            # Applying a policy makes the groups agree again
            model.set_fsdp_policy(policy, recurse=False)
            self.assertEqual(model.get_fsdp_policy(), policy)
            self.assertEqual(getattr(groups[1], field), original)

        # Both groups follow set/scope
        with model.fsdp_policy(
            requires_gradient_sync=False, reshard_after_forward=False, recurse=False
        ):
            for group in groups:
                self.assertFalse(group.reduce_grads)
                self.assertIsNone(group.post_forward_mesh_info)
        for group in groups:
            self.assertTrue(group.reduce_grads)
            self.assertIs(group.post_forward_mesh_info, group.mesh_info)

    def test_int_with_groups_on_a_smaller_mesh(self):
        """
        Public arguments only: ``fully_shard(..., mesh=<4 ranks>,
        shard_placement_fn=<lm_head on a 2-rank sub-mesh>,
        reshard_after_forward=2)``, as for expert-parallel MoE. The group on
        the 4-rank mesh reshards to a post-forward mesh of 2 ranks, and the
        group on the 2-rank mesh to its own mesh (``2`` is its shard mesh
        size), yet the module has one policy: ``get_fsdp_policy()`` returns the
        ``2`` it was given (revision 2 raised ``ValueError``), round trips and
        scopes change nothing and create no mesh or group, switching to
        ``True``/``False``/``None`` and back gives each group its mesh again,
        and training steps with a no-sync microbatch match a reference.
        """
        mesh_1d = init_device_mesh("cpu", (4,))
        mesh_2d = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
        ep_mesh_info = FSDPMeshInfo(mesh_2d["ep"], shard_mesh_dim=0)

        def shard_placement_fn(param: nn.Parameter):
            if any(param is p for p in model.lm_head.parameters()):
                return ShardPlacementResult(Shard(0), ep_mesh_info)
            return None

        torch.manual_seed(0)
        model = Model()
        ref_model = copy.deepcopy(model)
        fully_shard(
            model,
            mesh=mesh_1d,
            reshard_after_forward=2,
            shard_placement_fn=shard_placement_fn,
        )
        groups = model._get_fsdp_state()._fsdp_param_groups
        self.assertEqual(len(groups), 2)
        (dp_group,) = [g for g in groups if g.mesh_info.shard_mesh_size == 4]
        (ep_group,) = [g for g in groups if g.mesh_info.shard_mesh_size == 2]
        dp_int_mesh_info = dp_group.post_forward_mesh_info
        self.assertEqual(dp_int_mesh_info.shard_mesh_size, 2)
        self.assertIs(ep_group.post_forward_mesh_info, ep_group.mesh_info)
        int_policy = FSDPPolicy(reshard_after_forward=2)

        def check_int_policy(where: str) -> None:
            self.assertEqual(model.get_fsdp_policy(), int_policy, where)
            self.assertIs(dp_group.post_forward_mesh_info, dp_int_mesh_info, where)
            self.assertIs(ep_group.post_forward_mesh_info, ep_group.mesh_info, where)

        check_int_policy("after fully_shard")
        self._round_trip(model, recurse=False, where="before lazy init")
        with _count_mesh_and_group_creation() as created:
            for raf in (True, False, None):
                model.set_fsdp_policy(
                    FSDPPolicy(reshard_after_forward=raf), recurse=False
                )
                self.assertEqual(
                    model.get_fsdp_policy(), FSDPPolicy(reshard_after_forward=raf)
                )
                expected = None if raf is False else "mesh"
                for group in groups:
                    if expected is None:
                        self.assertIsNone(group.post_forward_mesh_info, raf)
                    else:
                        self.assertIs(
                            group.post_forward_mesh_info, group.mesh_info, raf
                        )
                model.set_fsdp_policy(int_policy, recurse=False)
                check_int_policy(f"back from {raf}")
            # The pristine setter keeps the state's value too
            model.set_reshard_after_forward(True)
            self.assertEqual(
                model.get_fsdp_policy(), FSDPPolicy(reshard_after_forward=True)
            )
            model.set_fsdp_policy(int_policy, recurse=False)
        self.assertEqual(created["mesh"], 0)
        self.assertEqual(created["group"], 0)
        check_int_policy("after switching")

        # Every rank uses the same inputs, so the gradients of the group on
        # the 2-rank mesh (reduced over 2 ranks only) match the reference
        inputs = _local_inputs(0, 2 * NUM_MICROBATCHES, seed=7)
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        ref_optim = torch.optim.SGD(ref_model.parameters(), lr=0.1)
        for step in range(2):
            for mb in range(NUM_MICROBATCHES):
                inp = inputs[step * NUM_MICROBATCHES + mb]
                is_last = mb == NUM_MICROBATCHES - 1
                with model.fsdp_policy(
                    requires_gradient_sync=is_last, recurse=True
                ) as applied:
                    self.assertEqual(
                        applied,
                        FSDPPolicy(
                            requires_gradient_sync=is_last, reshard_after_forward=2
                        ),
                    )
                    _loss(model(inp)).backward()
                check_int_policy(f"step {step}, microbatch {mb}")
                _loss(ref_model(inp)).backward()
            self._check_grads_and_step(model, ref_model, optim, ref_optim, str(step))
        for param, ref_param in zip(model.parameters(), ref_model.parameters()):
            self.assertEqual(param.full_tensor(), ref_param)
        self._round_trip(model, recurse=True, where="after training")

    def test_hsdp_gradient_sync_and_all_reduce(self):
        """
        HSDP (2x2): ``requires_gradient_sync`` and ``requires_all_reduce`` are
        independent through the value API; a 3-microbatch accumulation that
        turns all-reduce off for all but the last microbatch all-reduces once
        per group per step and matches a single-process reference. The old
        setters keep their coupling.
        """
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        torch.manual_seed(0)
        base = Model()
        model = _shard(copy.deepcopy(base), mesh=mesh)
        groups = fsdp_param_groups(model)
        num_groups = len(groups)
        self.assertEqual(num_groups, 3)

        # Independence
        model.set_requires_all_reduce(False)
        with model.fsdp_policy(requires_gradient_sync=False, recurse=True) as applied:
            self.assertEqual(
                applied,
                FSDPPolicy(requires_gradient_sync=False, requires_all_reduce=False),
            )
            for group in groups:
                self.assertFalse(group.reduce_grads)
                self.assertFalse(group.all_reduce_grads)
            with model.fsdp_policy(requires_gradient_sync=True, recurse=True) as inner:
                self.assertFalse(inner.requires_all_reduce)
                for group in groups:
                    self.assertTrue(group.reduce_grads)
                    self.assertFalse(group.all_reduce_grads)
        for group in groups:
            self.assertTrue(group.reduce_grads)
            self.assertFalse(group.all_reduce_grads)
        model.set_requires_all_reduce(True)
        with model.fsdp_policy(requires_gradient_sync=False, recurse=True) as applied:
            self.assertTrue(applied.requires_all_reduce)
            for group in groups:
                self.assertTrue(group.all_reduce_grads)
        with model.fsdp_policy(requires_all_reduce=False, recurse=True) as applied:
            self.assertTrue(applied.requires_gradient_sync)
            for group in groups:
                self.assertTrue(group.reduce_grads)
        # The old setter still couples them
        model.set_requires_all_reduce(False)
        model.set_requires_gradient_sync(True)
        for name, policy in fsdp_policies(model).items():
            self.assertEqual(policy, FSDPPolicy(), name)
        for group in groups:
            self.assertTrue(group.all_reduce_grads)
        model.set_requires_gradient_sync(False)
        for group in groups:
            self.assertFalse(group.all_reduce_grads)
        model.set_requires_gradient_sync(True)
        self.assertEqual(
            fsdp_policies(model), {k: FSDPPolicy() for k in fsdp_policies(model)}
        )

        self.run_subtests(
            {"loop": ["no_all_reduce", "no_sync", "old_setters"]},
            self._test_hsdp_accumulation,
            base=base,
            mesh=mesh,
        )

    def _test_hsdp_accumulation(self, loop: str, base: Model, mesh: DeviceMesh):
        model = _shard(copy.deepcopy(base), mesh=mesh)
        ref_model = copy.deepcopy(base)
        num_groups = len(fsdp_param_groups(model))
        counter = CollectiveCounter()
        num_steps = 2
        for step in range(num_steps):
            local = _local_inputs(self.rank, NUM_MICROBATCHES, seed=10 + step)
            all_inputs = _all_inputs(local)
            for mb in range(NUM_MICROBATCHES):
                is_last = mb == NUM_MICROBATCHES - 1
                if loop == "no_all_reduce":
                    ctx = (
                        model.fsdp_policy(requires_all_reduce=False, recurse=True)
                        if not is_last
                        else contextlib.nullcontext()
                    )
                elif loop == "no_sync":
                    ctx = (
                        model.fsdp_policy(requires_gradient_sync=False, recurse=True)
                        if not is_last
                        else contextlib.nullcontext()
                    )
                else:
                    # What code written against the old setters does; the
                    # second call turns all-reduce back on
                    if not is_last:
                        model.set_requires_all_reduce(False)
                    model.set_requires_gradient_sync(True)
                    ctx = contextlib.nullcontext()
                counter.reset()
                with ctx, counter.count():
                    _loss(model(local[mb])).backward()
                if loop == "no_all_reduce":
                    expected_rs = num_groups
                    expected_ar = num_groups if is_last else 0
                elif loop == "no_sync":
                    expected_rs = expected_ar = num_groups if is_last else 0
                else:
                    expected_rs = expected_ar = num_groups
                self.assertEqual(counter["reduce_scatter"], expected_rs, f"mb {mb}")
                self.assertEqual(counter["all_reduce"], expected_ar, f"mb {mb}")
                # The caller's policy is back after each microbatch
                for name, policy in fsdp_policies(model).items():
                    self.assertEqual(policy, FSDPPolicy(), f"{name} mb {mb}")
                ref_inp = torch.cat([inputs[mb] for inputs in all_inputs])
                _loss(ref_model(ref_inp)).backward()
            for (name, param), ref_param in zip(
                model.named_parameters(), ref_model.parameters()
            ):
                self.assertEqual(
                    param.grad.full_tensor(),
                    ref_param.grad,
                    rtol=1e-5,
                    atol=1e-6,
                    msg=f"{loop} step {step} {name}",
                )
            model.zero_grad()
            ref_model.zero_grad()


class TestFullyShardPolicyParameterless(_PolicyTestBase):
    """Policy of a state whose module has no parameters of its own (world 4)."""

    @property
    def world_size(self) -> int:
        return 4

    def test_parameterless_int_validated_and_normalized(self):
        """
        A module without parameters validates and normalizes an ``int``
        ``reshard_after_forward`` against its mesh like ``fully_shard`` does:
        on a 1-D mesh of 4, ``3`` raises ``ValueError`` with nothing changed,
        and ``4`` / ``1`` read back as ``True`` / ``False``.
        """
        mesh = init_device_mesh("cpu", (4,))
        torch.manual_seed(0)
        model = _shard(Model(), mesh=mesh, shard_body=True)
        body = model.body
        self.assertEqual(len(body._get_fsdp_state()._fsdp_param_groups), 0)
        # fully_shard itself validates an int for a parameterless module
        with self.assertRaisesRegex(ValueError, "factor"):
            fully_shard(nn.Sequential(), mesh=mesh, reshard_after_forward=3)
        # ... and normalizes it
        self.assertEqual(
            fully_shard(
                nn.Sequential(), mesh=mesh, reshard_after_forward=4
            ).get_fsdp_policy(),
            FSDPPolicy(reshard_after_forward=True),
        )
        # Through the recursive call, a module with parameters raises first
        with self.assertRaises(ValueError):
            model.set_fsdp_policy(FSDPPolicy(reshard_after_forward=3), recurse=True)
        self.assertEqual(body.get_fsdp_policy(), FSDPPolicy())
        # Through set_fsdp_policy on the parameterless module itself
        for value, expected in ((4, True), (1, False)):
            body.set_fsdp_policy(FSDPPolicy(reshard_after_forward=value), recurse=False)
            self.assertEqual(
                body.get_fsdp_policy(),
                FSDPPolicy(reshard_after_forward=expected),
                f"reshard_after_forward={value}",
            )
        body.set_fsdp_policy(FSDPPolicy(), recurse=False)
        # Like a module with parameters, only the int it was built with:
        # revision 2 accepted 2 here, which a module with parameters refuses
        with self.assertRaisesRegex(ValueError, "not the int this module was given"):
            body.set_fsdp_policy(FSDPPolicy(reshard_after_forward=2), recurse=False)
        self.assertEqual(body.get_fsdp_policy(), FSDPPolicy())
        built_with_2 = fully_shard(nn.Sequential(), mesh=mesh, reshard_after_forward=2)
        for value in (2, True, False, None, 2):
            built_with_2.set_fsdp_policy(
                FSDPPolicy(reshard_after_forward=value), recurse=False
            )
            self.assertEqual(
                built_with_2.get_fsdp_policy(), FSDPPolicy(reshard_after_forward=value)
            )
        with self.assertRaisesRegex(ValueError, "reshard_after_forward|factor"):
            body.set_fsdp_policy(FSDPPolicy(reshard_after_forward=3), recurse=False)
        self.assertEqual(body.get_fsdp_policy(), FSDPPolicy())
        with self.assertRaisesRegex(ValueError, "reshard_after_forward|factor"):
            with body.fsdp_policy(reshard_after_forward=3, recurse=False):
                pass
        self.assertEqual(body.get_fsdp_policy(), FSDPPolicy())


# ---------------------------------------------------------------------------
# replicate(): ReplicateModule is an FSDPModule
# ---------------------------------------------------------------------------
def _replicate(model: Model, *, replicate_body: bool = False) -> Model:
    """``replicate`` each block, optionally the parameterless ``body``, then the root."""
    for block in model.body:
        replicate(block)
    if replicate_body:
        replicate(model.body)
    replicate(model)
    return model


class TestFullyShardPolicyReplicate(_PolicyTestBase):
    @property
    def world_size(self) -> int:
        return 2

    def test_replicate_policy_round_trip(self):
        """
        Every module of a ``replicate()``d tree (blocks, a parameterless
        container, the root) has a policy, before and after lazy init:
        ``reshard_after_forward`` reads ``False`` (replicate never reshards),
        it round-trips exactly, and ``reshard_after_forward=True`` or an
        ``int`` raises ``ValueError`` naming the module type, with nothing
        changed. Revision 2 raised ``ValueError`` from ``get_fsdp_policy()``
        on every module with parameters.
        """
        torch.manual_seed(0)
        model = _replicate(Model(), replicate_body=True)
        expected = FSDPPolicy(reshard_after_forward=False)
        inp = torch.randn(4, DIM)
        for where in ("before lazy init", "after lazy init"):
            for name, policy in fsdp_policies(model).items():
                self.assertEqual(policy, expected, f"{where}: {name!r}")
            self._round_trip(model, recurse=False, where=where)
            self._round_trip(model, recurse=True, where=where)
            before = _snapshot(model)
            for value in (True, 2):
                for module, type_name in (
                    (model, "ReplicateModel"),
                    (model.body, "ReplicateSequential"),
                    (model.body[0], "ReplicateBlock"),
                ):
                    with self.assertRaisesRegex(ValueError, type_name):
                        module.set_fsdp_policy(
                            FSDPPolicy(reshard_after_forward=value), recurse=False
                        )
                with self.assertRaisesRegex(ValueError, "ReplicateModel"):
                    with model.fsdp_policy(reshard_after_forward=value, recurse=True):
                        pass
            self._assert_same_snapshot(before, _snapshot(model), where)
            _loss(model(inp)).backward()
        # None is FSDP's automatic choice, which for replicate is no reshard
        model.set_fsdp_policy(FSDPPolicy(), recurse=True)
        self.assertEqual(model.get_fsdp_policy(), FSDPPolicy())
        model.set_fsdp_policy(expected, recurse=True)
        self.assertEqual(set(fsdp_policies(model).values()), {expected})

    @parametrize("field", ["requires_gradient_sync", "requires_all_reduce"])
    def test_replicate_no_sync_accumulation(self, field: str):
        """
        ``fsdp_policy(<field>=False, recurse=True)`` on a ``replicate()``d
        model accumulates without any all-reduce; the next backward reduces
        once per group, and two optimizer steps match a single-process
        reference. ``requires_all_reduce`` is the flag that matters for
        replicate (it has no reduce-scatter).
        """
        num_steps, num_microbatches = 2, 2
        local_inputs = _local_inputs(self.rank, num_steps * num_microbatches, seed=7)
        all_inputs = _all_inputs(local_inputs)
        torch.manual_seed(0)
        model = Model()
        ref_model = copy.deepcopy(model)
        _replicate(model)
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        ref_optim = torch.optim.SGD(ref_model.parameters(), lr=0.1)
        num_groups = len(fsdp_param_groups(model))
        policies = fsdp_policies(model)
        counter = CollectiveCounter()
        for step in range(num_steps):
            for microbatch in range(num_microbatches):
                index = step * num_microbatches + microbatch
                last = microbatch == num_microbatches - 1
                counter.reset()
                with counter.count():
                    if last:
                        _loss(model(local_inputs[index])).backward()
                    else:
                        with model.fsdp_policy(recurse=True, **{field: False}):
                            _loss(model(local_inputs[index])).backward()
                self.assertEqual(
                    counter["all_reduce"], num_groups if last else 0, f"{index}"
                )
                self.assertEqual(fsdp_policies(model), policies)
                ref_inp = torch.cat([inputs[index] for inputs in all_inputs])
                _loss(ref_model(ref_inp)).backward()
            self._check_grads_and_step(model, ref_model, optim, ref_optim, f"{step}")


# ---------------------------------------------------------------------------
# The per-field setters are 2.15.0's, for every input 2.15.0 accepted
# ---------------------------------------------------------------------------
# What each setter writes to a parameter group, as 2.15.0 does
_SETTER_FIELDS = {
    "set_requires_gradient_sync": ("reduce_grads", "all_reduce_grads"),
    "set_requires_all_reduce": ("all_reduce_grads",),
    "set_reshard_after_backward": ("reshard_after_backward",),
}
_SETTER_POLICY_FIELDS = {
    "set_requires_gradient_sync": ("requires_gradient_sync", "requires_all_reduce"),
    "set_requires_all_reduce": ("requires_all_reduce",),
    "set_reshard_after_backward": ("reshard_after_backward",),
}
# Values 2.15.0 accepts: it stores them and FSDP tests their truth
_BOOL_LIKE_VALUES = (np.bool_(False), np.bool_(True), 0, 1, None, False, True)


class TestFullyShardOldSetters(_PolicyTestBase):
    @property
    def world_size(self) -> int:
        return 2

    def _build(self, kind: str) -> Model:
        torch.manual_seed(0)
        if kind == "replicate":
            return _replicate(Model(), replicate_body=True)
        return _shard(Model(), shard_body=True)

    @parametrize("kind", ["fully_shard", "replicate"])
    @parametrize("setter", sorted(_SETTER_FIELDS))
    def test_setter_bool_like(self, setter: str, kind: str):
        """
        ``numpy.bool_``, ``0``/``1`` and ``None`` are accepted by every flag
        setter as in 2.15.0, on states with parameters (stored as given) and
        without (the parameterless ``body``), on the root and recursively;
        ``get_fsdp_policy()`` then reads the value FSDP acts on, never raises,
        and round-trips: ``set_fsdp_policy(get_fsdp_policy())`` and
        an ``fsdp_policy`` scope that changes nothing leave the stored object
        itself (revision 3 stored ``False`` for a setter's ``0``); a scope
        that changes the field restores it as a ``bool``. Revision 2 raised ``TypeError`` on the parameterless
        state after changing the modules before it, and a non-bool stored on
        a state with parameters made ``get_fsdp_policy()`` raise.
        """
        for value in _BOOL_LIKE_VALUES:
            for recurse in (True, False):
                where = f"{setter}({value!r}, recurse={recurse})"
                model = self._build(kind)
                targets = _fsdp_modules(model) if recurse else [model.body, model]
                for target in [model] if recurse else targets:
                    getattr(target, setter)(value, recurse=recurse)
                for module in targets:
                    for group in module._get_fsdp_state()._fsdp_param_groups:
                        for field in _SETTER_FIELDS[setter]:
                            self.assertIs(getattr(group, field), value, where)
                    policy = module.get_fsdp_policy()
                    for field in _SETTER_POLICY_FIELDS[setter]:
                        self.assertIs(getattr(policy, field), bool(value), where)
                    module.set_fsdp_policy(policy, recurse=False)
                    self.assertEqual(module.get_fsdp_policy(), policy, where)
                    with module.fsdp_policy(recurse=False):
                        pass
                    # The round trips keep the stored value itself
                    groups = module._get_fsdp_state()._fsdp_param_groups
                    for group in groups:
                        for field in _SETTER_FIELDS[setter]:
                            self.assertIs(getattr(group, field), value, where)
                    # A scope that changes the field restores its value as the
                    # policy holds it, a bool (documented in FSDPPolicy)
                    with module.fsdp_policy(
                        requires_gradient_sync=not policy.requires_gradient_sync,
                        reshard_after_backward=not policy.reshard_after_backward,
                        recurse=False,
                    ):
                        pass
                    for group in groups:
                        for field in _SETTER_FIELDS[setter]:
                            changed = field != "all_reduce_grads"
                            self.assertIs(
                                getattr(group, field),
                                bool(value) if changed else value,
                                where,
                            )
                # FSDP acts on the value as 2.15.0 does: one training step
                _loss(model(torch.randn(4, DIM))).backward()
                for name, policy in fsdp_policies(model).items():
                    self.assertIsInstance(policy, FSDPPolicy, f"{where}: {name!r}")

    @parametrize("kind", ["fully_shard", "replicate"])
    def test_set_is_last_backward_bool_like(self, kind: str):
        """
        ``set_is_last_backward`` stores what it is given, as in 2.15.0, and an
        ``fsdp_policy`` scope restores that very object.
        """
        model = self._build(kind)
        state_ctx = model._get_fsdp_state()._state_ctx
        for value in _BOOL_LIKE_VALUES:
            model.set_is_last_backward(value)
            self.assertIs(state_ctx.is_last_backward, value)
            with model.fsdp_policy(is_last_backward=True, recurse=True):
                pass
            self.assertIs(state_ctx.is_last_backward, value)
            fsdp_policies(model)  # does not raise

    def test_set_reshard_after_forward_replicate_changes_nothing(self):
        """
        ``set_reshard_after_forward`` on a ``replicate()``d tree raises
        ``AssertionError`` as in 2.15.0 (replicate cannot reshard), now
        before changing any module, so every policy still reads and
        round-trips. Revision 2 (and 2.15.0) changed the modules visited
        before the first one with parameters.
        """
        model = self._build("replicate")
        before = _snapshot(model)
        policies = fsdp_policies(model)
        for value in (True, False):
            with self.assertRaises(AssertionError):
                model.set_reshard_after_forward(value)
            self._assert_same_snapshot(before, _snapshot(model), f"{value}")
            self.assertEqual(fsdp_policies(model), policies)
        # The parameterless container alone: nothing to reshard, so it reads
        # what replicate does
        model.body.set_reshard_after_forward(True, recurse=False)
        self.assertEqual(
            model.body.get_fsdp_policy(), FSDPPolicy(reshard_after_forward=False)
        )
        model.body.set_fsdp_policy(model.body.get_fsdp_policy(), recurse=False)


instantiate_parametrized_tests(TestFullyShardPolicyReplicate)
instantiate_parametrized_tests(TestFullyShardOldSetters)


if __name__ == "__main__":
    run_tests()
