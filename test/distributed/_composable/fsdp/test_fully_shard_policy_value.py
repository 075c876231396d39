# Owner(s): ["oncall: distributed"]
"""
Tests for the ``FSDPPolicy`` value type (pytorch/pytorch#203177): a frozen,
comparable, hashable dataclass exported from ``torch.distributed.fsdp`` whose
fields are checked when it is built. Reading and applying policies on FSDP
modules is tested in ``test_fully_shard_policy.py``.
"""

import dataclasses

from torch.distributed.fsdp import FSDPPolicy
from torch.testing._internal.common_utils import run_tests, TestCase


class TestFSDPPolicyValue(TestCase):
    def test_frozen_comparable_hashable(self):
        policy = FSDPPolicy()
        self.assertEqual(
            dataclasses.asdict(policy),
            {
                "requires_gradient_sync": True,
                "requires_all_reduce": True,
                "reshard_after_forward": None,
                "reshard_after_backward": True,
            },
        )
        self.assertTrue(dataclasses.is_dataclass(FSDPPolicy))
        with self.assertRaises(dataclasses.FrozenInstanceError):
            policy.requires_gradient_sync = False  # type: ignore[misc]
        for value in (True, False, None, 2):
            a = FSDPPolicy(requires_all_reduce=False, reshard_after_forward=value)
            b = FSDPPolicy(requires_all_reduce=False, reshard_after_forward=value)
            self.assertIsNot(a, b)
            self.assertEqual(a, b)
            self.assertEqual(hash(a), hash(b))
            self.assertNotEqual(a, FSDPPolicy(reshard_after_forward=value))
        # Every field takes part in equality and hashing
        variants = {
            FSDPPolicy(),
            FSDPPolicy(requires_gradient_sync=False),
            FSDPPolicy(requires_all_reduce=False),
            FSDPPolicy(reshard_after_forward=True),
            FSDPPolicy(reshard_after_forward=False),
            FSDPPolicy(reshard_after_forward=2),
            FSDPPolicy(reshard_after_backward=False),
        }
        self.assertEqual(len(variants), 7)
        self.assertIn(FSDPPolicy(reshard_after_forward=2), variants)
        replaced = dataclasses.replace(policy, reshard_after_backward=False)
        self.assertEqual(replaced, FSDPPolicy(reshard_after_backward=False))
        self.assertEqual(policy, FSDPPolicy())  # unchanged

    def test_field_checks(self):
        for name in (
            "requires_gradient_sync",
            "requires_all_reduce",
            "reshard_after_backward",
        ):
            for bad in (1, 0, None, "True", 1.0):
                with self.assertRaisesRegex(TypeError, name):
                    FSDPPolicy(**{name: bad})
        for bad in ("True", "2", 2.0, [2]):
            with self.assertRaisesRegex(TypeError, "reshard_after_forward"):
                FSDPPolicy(reshard_after_forward=bad)
        for bad in (0, -1, -4):
            with self.assertRaisesRegex(ValueError, "reshard_after_forward"):
                FSDPPolicy(reshard_after_forward=bad)
        # Bools are not ints here, and mesh-dependent ints are checked on apply
        for ok in (True, False, None, 1, 3, 4, 1024):
            self.assertEqual(
                FSDPPolicy(reshard_after_forward=ok).reshard_after_forward, ok
            )

    def test_exported(self):
        import torch.distributed.fsdp as fsdp_pkg

        self.assertIs(fsdp_pkg.FSDPPolicy, FSDPPolicy)
        self.assertIn("FSDPPolicy", fsdp_pkg.__all__)
        self.assertEqual(FSDPPolicy.__module__, "torch.distributed.fsdp")


if __name__ == "__main__":
    run_tests()
