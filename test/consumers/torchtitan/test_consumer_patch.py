# Owner(s): ["oncall: distributed"]
"""
The installed torchtitan carries the consumer series (consumers/torchtitan/)
exactly, and the files it patches reference no private FSDP state: the
consumer runs on the public lifecycle APIs only.

Every series under consumers/torchtitan/ (the 0.3.0 release's and the one
against torchtitan main, main-<sha>) adds no private FSDP reference and
replaces the wrapper's setter calls with the public calls, read from the
patch files alone. The main series' whole patched files need torchtitan's
sources: test/tools/test_consumers.py checks them (git am of the export, 0
private references) when TORCHTITAN_SOURCE points at them.
"""

import importlib.util
import json
import re
from pathlib import Path

from torch.testing._internal.common_utils import run_tests, TestCase


REPO = Path(__file__).resolve().parents[3]
SERIES_DIR = REPO / "consumers" / "torchtitan" / "0.3.0"
ALL_SERIES_DIRS = sorted(
    d for d in (REPO / "consumers" / "torchtitan").iterdir() if (d / "series").is_file()
)
SETTERS = (
    "set_reshard_after_forward(",
    "set_reshard_after_backward(",
    "set_requires_gradient_sync(",
)

# Counted independently of torch_patches/consumers.py
PRIVATE_NAMES = (
    "_get_fsdp_state",
    "_fsdp_param_group",  # also matches _fsdp_param_groups
    "_state_ctx",
    "_post_forward",
    "_modules_to_run_forward",
    "_lazy_init",
    "_comm_ctx",
    "_fully_shard",
)
PUBLIC_CALLS = ("partial_backward(", "finish_forward(", "fsdp_policy(")


def _patch_names(series_dir: Path = SERIES_DIR) -> list[str]:
    return [
        line.strip()
        for line in (series_dir / "series").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]


def _changed_lines(series_dir: Path, name: str, sign: str) -> list[str]:
    """The lines a patch adds (``sign="+"``) or removes (``"-"``), without the sign."""
    return [
        line[1:]
        for line in (series_dir / name).read_text().splitlines()
        if line.startswith(sign) and not line.startswith(sign * 3)
    ]


def _all_patched_paths() -> list[str]:
    paths = []
    for name in _patch_names():
        for line in (SERIES_DIR / name).read_text().splitlines():
            m = re.match(r"^\+\+\+ b/(\S+)$", line)
            if m and m.group(1) not in paths:
                paths.append(m.group(1))
    return paths


def _patched_paths() -> list[str]:
    """The patched files an installed torchtitan holds (its package); the
    others (the PR's tests/) are only exported."""
    return [p for p in _all_patched_paths() if p.startswith("torchtitan/")]


def _site_root() -> Path:
    spec = importlib.util.find_spec("torchtitan")
    assert spec is not None and spec.submodule_search_locations
    return Path(list(spec.submodule_search_locations)[0]).parent


class TestTorchtitanConsumerPatch(TestCase):
    def test_installed_torchtitan_is_patched(self):
        """The marker names this series and the files hash as it recorded."""
        import hashlib

        root = _site_root()
        (dist_info,) = root.glob("torchtitan-0.3.0.dist-info")
        marker = json.loads((dist_info / "TORCH_PATCHES_CONSUMER.json").read_text())
        shipped = [
            {
                "name": name,
                "sha256": hashlib.sha256((SERIES_DIR / name).read_bytes()).hexdigest(),
            }
            for name in (p["name"] for p in marker["series"]["patches"])
        ]
        self.assertEqual(marker["series"]["patches"], shipped)
        self.assertEqual(sorted(marker["files"]), sorted(_patched_paths()))
        for rel, entry in marker["files"].items():
            data = (root / rel).read_bytes()
            self.assertEqual(hashlib.sha256(data).hexdigest(), entry["patched_sha256"], rel)

    def test_no_private_fsdp_references(self):
        """Zero private FSDP references in every patched file; the pristine
        release used none either in these files, but drove FSDP through the
        global setters that the public lifecycle APIs replace."""
        root = _site_root()
        paths = _patched_paths()
        self.assertIn("torchtitan/components/loss.py", paths)
        for rel in paths:
            text = (root / rel).read_text()
            counts = {name: text.count(name) for name in PRIVATE_NAMES}
            self.assertEqual(sum(counts.values()), 0, f"{rel}: {counts}")
            for setter in SETTERS:
                self.assertNotIn(setter, text, rel)
        # The PR's own test changes (not installed): no private names added
        self.assertEqual(
            [p for p in _all_patched_paths() if p not in paths],
            ["tests/unit_tests/test_loss.py"],
        )
        for name in _patch_names():
            added = "\n".join(_changed_lines(SERIES_DIR, name, "+"))
            counts = {n: added.count(n) for n in PRIVATE_NAMES}
            self.assertEqual(sum(counts.values()), 0, f"{name}: {counts}")
        loss_py = (root / "torchtitan/components/loss.py").read_text()
        for call in PUBLIC_CALLS:
            self.assertIn(call, loss_py)
        # Every fsdp_policy call names recurse explicitly
        for m in re.finditer(r"fsdp_policy\((.*?)\)", loss_py, re.DOTALL):
            self.assertIn("recurse=", m.group(1))


class TestTorchtitanConsumerSeries(TestCase):
    def test_every_series_uses_public_calls_only(self):
        """Each shipped series (0.3.0 and main-<sha>) adds no private FSDP
        reference, removes the wrapper's setter calls and adds none, and adds
        the public calls (every fsdp_policy call naming recurse)."""
        names = [d.name for d in ALL_SERIES_DIRS]
        self.assertIn("0.3.0", names)
        self.assertTrue([n for n in names if n.startswith("main-")], names)
        for series_dir in ALL_SERIES_DIRS:
            patches = _patch_names(series_dir)
            self.assertEqual(len(patches), 2, series_dir.name)
            for name in patches:
                added = "\n".join(_changed_lines(series_dir, name, "+"))
                counts = {n: added.count(n) for n in PRIVATE_NAMES}
                self.assertEqual(sum(counts.values()), 0, f"{series_dir.name}/{name}: {counts}")
                for setter in SETTERS:
                    self.assertNotIn(f".{setter}", added, f"{series_dir.name}/{name}")
            wrapper = patches[0]
            added = "\n".join(_changed_lines(series_dir, wrapper, "+"))
            removed = "\n".join(_changed_lines(series_dir, wrapper, "-"))
            for setter in SETTERS:
                self.assertIn(f"lm_head.{setter}", removed, series_dir.name)
            for call in PUBLIC_CALLS:
                self.assertIn(f"lm_head.{call}", added, series_dir.name)
            for m in re.finditer(r"fsdp_policy\((.*?)\)", added, re.DOTALL):
                self.assertIn("recurse=", m.group(1), series_dir.name)


if __name__ == "__main__":
    run_tests()
