"""docs/migration.md: every before/after snippet runs, and the numbers the page states are the
ones the snippets give now.

``tools/examples/migration.py`` executes each snippet on this interpreter's torch (the
patched one: the "after" snippets need the new API), CPU, gloo, 2 forked ranks in one
spawn, and writes a result file; the page's measured block must be that file rendered, and
the committed result file (tools/bench/results/migration.json) must equal the fresh one.
The page must also name every private FSDP name a consumer is known to use (the names
torch_patches.consumers counts, the installed torchtitan's private imports, the setters of
torchtitan 0.3.0's chunk loop).
"""

import importlib.util
import json
import re
import subprocess
import sys

import pytest

from tooling import REPO

SCRIPT = REPO / "tools" / "examples" / "migration.py"
RESULTS = REPO / "tools" / "bench" / "results" / "migration.json"
PRISTINE = REPO / "tools" / "bench" / "results" / "migration-pristine.json"
DOC = REPO / "docs" / "migration.md"
#: Known idioms beyond torch_patches.consumers.PRIVATE_FSDP_NAMES.
MORE_NAMES = ("_post_backward_pending", "_fsdp_param_groups", "_register_pre_backward_hook", "_training_state",
              "_is_root", "iter_forward_root", "post_forward_order", "reduce_grads", "all_reduce_grads",
              "reshard_after_backward", "post_forward_mesh_info", "is_last_backward", "unsharded_accumulated_grad",
              "_unsharded_param", "torch.distributed._composable.fsdp")
#: torchtitan 0.3.0's ChunkedLossWrapper's per-chunk setter idiom.
SETTERS = ("set_reshard_after_forward", "set_reshard_after_backward", "set_requires_gradient_sync", "reshard()")


def _migration():
    spec = importlib.util.spec_from_file_location("migration_example", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def fresh(tmp_path_factory):
    import torch.distributed.fsdp as fsdp
    assert hasattr(fsdp.FSDPModule, "partial_backward"), \
        "the migration snippets need the series applied to this torch (tools/run_tests.sh does that)"
    out = tmp_path_factory.mktemp("migration") / "migration.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "-o", str(out)], capture_output=True, text=True,
                          timeout=900, cwd=tmp_path_factory.getbasetemp())
    assert proc.returncode == 0 and out.is_file(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_every_section_has_before_and_after():
    m = _migration()
    found = m.snippets()
    assert set(found) == set(m.TRAIN) | set(m.EVAL) | set(m.QUERIES), sorted(found)
    for name, pair in found.items():
        assert set(pair) == {"before", "after"}, name


def test_doc_numbers_are_what_the_snippets_give(fresh):
    m = _migration()
    text = DOC.read_text()
    block = m.BEGIN + text.split(m.BEGIN, 1)[1].split(m.END, 1)[0] + m.END
    assert block == m.render(fresh), \
        "docs/migration.md's measured block is stale: run `python tools/examples/migration.py " \
        "-o tools/bench/results/migration.json --render`"
    committed = json.loads(RESULTS.read_text())
    for results in (committed, fresh):
        results["setup"].pop("torch", None)
    assert committed == fresh


def test_what_the_doc_says(fresh):
    """The claims of the prose, on the fresh numbers."""
    train, query = fresh["train"], fresh["query"]
    for name, pair in train.items():  # every program trains like the float64 reference
        for side in pair.values():
            assert all(d in ("0", "<1e-12") for d in side["max_diff"]), (name, side)
    setters = train["setters"]
    assert sum(setters["after"]["rs"]) < sum(setters["before"]["rs"])
    # the scope reshards the group at its exit and the decoder backward gathers it again (api.md section 8)
    assert sum(setters["after"]["ag"]) <= sum(setters["before"]["ag"])
    assert setters["after"]["peak_gathered_bytes"] < setters["before"]["peak_gathered_bytes"]
    assert not all(setters["before"]["policy_kept"]) and all(setters["after"]["policy_kept"])
    for name in ("complete", "policy", "finish-trainable", "finish-frozen"):  # same collectives
        assert train[name]["before"]["rs"] == train[name]["after"]["rs"], name
        assert train[name]["before"]["ag"] == train[name]["after"]["ag"], name
    groups = 4  # 2 blocks, the head group, the root
    assert train["finish-trainable"]["after"]["rs"] == [groups * 2] * 2  # once per group and microbatch
    assert train["finish-full"]["after"]["rs"] == [(groups + 1) * 2] * 2  # the head group twice
    assert sum(train["finish-full"]["before"]["ag"]) < sum(train["finish-full"]["after"]["ag"])
    loop = train["finish-loop"]  # without a scope: finish_forward reshards between the chunks
    assert loop["before"]["rs"] == loop["after"]["rs"] and sum(loop["after"]["rs"]) > sum(
        train["finish-trainable"]["after"]["rs"])
    assert sum(loop["before"]["ag"]) < sum(loop["after"]["ag"])
    assert loop["before"]["peak_gathered_bytes"] > loop["after"]["peak_gathered_bytes"]
    for name in ("finish-trainable", "finish-frozen"):  # inside a scope: nothing measurable
        assert train[name]["before"] == train[name]["after"], name
    assert train["policy"]["after"]["rs"] == [groups] * 2  # once per group and step
    without, with_ = query["finish-eval"]["before"], query["finish-eval"]["after"]
    assert without["post_forward_order_after_each_eval"] == [0, 1, 2]
    assert with_["post_forward_order_after_each_eval"] == [0, 0, 0]
    assert without["gathered_bytes_after_eval"] > with_["gathered_bytes_after_eval"]
    for name in ("import", "pending", "root", "unsharded", "reset"):
        assert query[name]["before"] == query[name]["after"], name
    assert query["pending"]["after"]["no_sync_microbatch"] is True
    assert query["pending"]["after"]["reducing_microbatch"] is False


def test_before_snippets_behave_as_on_2_15_0(fresh):
    """The recorded pristine-2.15.0 run of the before snippets that need nothing of the series
    (docs/migration.md, "Measured") gave what they give on the patched torch now."""
    pristine = json.loads(PRISTINE.read_text())
    assert pristine["setup"]["sides"] == ["before"] and "+" in pristine["setup"]["torch"]
    assert sorted(pristine["train"]) == ["complete", "finish-full", "setters"]
    for name, pair in pristine["train"].items():
        for key in ("rs", "ag", "max_diff"):
            assert pair["before"][key] == fresh["train"][name]["before"][key], (name, key)


def _torchtitan_private_names():
    """Private FSDP names the installed torchtitan (pristine loss.py included) uses."""
    from torch_patches.consumers import PRIVATE_FSDP_NAMES
    spec = importlib.util.find_spec("torchtitan")
    if spec is None or not spec.submodule_search_locations:
        return set()
    from pathlib import Path
    root = Path(list(spec.submodule_search_locations)[0])
    texts = [p.read_text(errors="replace") for p in root.rglob("*.py") if "tests" not in p.parts]
    for marker in root.parent.glob("torchtitan-*.dist-info/TORCH_PATCHES_CONSUMER.json"):
        for entry in json.loads(marker.read_text()).get("files", {}).values():
            if isinstance(entry.get("pristine"), str):
                texts.append(entry["pristine"])
    names = set()
    for text in texts:
        names.update(n for n in PRIVATE_FSDP_NAMES if n in text)
        for group, line in re.findall(r"from torch\.distributed\.fsdp\._fully_shard\.\w+ import "
                                      r"(?:\(([^)]*)\)|([\w, ]+))", text):
            names.update(n.strip() for n in (group or line).split(",") if n.strip())
        if "torch.distributed._composable.fsdp" in text:
            names.add("torch.distributed._composable.fsdp")
    return names


def test_every_private_name_is_mapped():
    from torch_patches.consumers import PRIVATE_FSDP_NAMES
    text = DOC.read_text()
    table = text.split("## Which private name maps to which public call", 1)[1].split("\n## ", 1)[0]
    names = set(PRIVATE_FSDP_NAMES) | set(MORE_NAMES) | set(SETTERS) | _torchtitan_private_names()
    missing = sorted(n for n in names if n not in table)
    assert not missing, f"docs/migration.md's table does not map {missing}"
    # in the table only: no runnable 2.15.0 idiom (writing post_forward_mesh_info back by hand does
    # not restore reshard_after_forward on the patched torch; fsdp_policy does)
    table_only = {"torch.distributed._composable.fsdp", "_post_forward", "_lazy_init", "post_forward_mesh_info"}
    for name in (set(PRIVATE_FSDP_NAMES) | set(MORE_NAMES)) - table_only:
        assert re.search(rf"# before: [\w-]+\n(?:(?!```).)*{re.escape(name)}", text, re.S), \
            f"no before snippet uses {name}"
