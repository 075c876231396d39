"""One torch's side of the parity run: imports torch once, forks the ranks of
every scenario and writes what each rank observed to a JSON file.

Run by ``runner.py`` as ``PYTHON worker.py --out FILE [-k PATTERN]``; the
interpreter decides which torch is measured. Each rank of a scenario is a fork
of this process (no second torch import) with its own gloo process group on a
fresh ``FileStore``; the parent kills ranks that outlive the scenario timeout
and records ``TIMEOUT``.
"""

import argparse
import datetime
import hashlib
import json
import logging
import os
import re
import signal
import sys
import tempfile
import threading
import time
import traceback
import warnings

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import catalogue  # noqa: E402


def preload() -> None:
    """Imports what every rank would otherwise import lazily (torch._dynamo alone is ~6 s)."""
    import torch._dynamo  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.pipelining  # noqa: F401
    import torch.distributed.tensor  # noqa: F401
    import torch.distributed._composable.replicate_with_fsdp  # noqa: F401
    import torch.nn.parallel  # noqa: F401
    import torch.utils.checkpoint  # noqa: F401
    import torch._functorch.aot_autograd  # noqa: F401

#: torch.distributed functions whose calls are recorded (those that exist).
COLLECTIVES = [
    "all_gather_single", "reduce_scatter_single", "all_gather_into_tensor", "reduce_scatter_tensor",
    "all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "scatter", "gather",
    "all_to_all", "all_to_all_single", "barrier", "monitored_barrier", "send", "recv", "isend",
    "irecv", "batch_isend_irecv", "send_object_list", "recv_object_list", "broadcast_object_list",
    "all_gather_object", "gather_object", "scatter_object_list", "all_reduce_coalesced",
]

_PREFIXES = sorted({p for p in (sys.prefix, sys.base_prefix, os.path.dirname(torch.__file__), HERE) if p},
                   key=len, reverse=True)


def normalise(text: str) -> str:
    """Drops what differs between two processes or venvs but not between behaviours."""
    for prefix in _PREFIXES:
        text = text.replace(prefix, "<prefix>")
    text = re.sub(r"0x[0-9a-fA-F]+", "0x?", text)
    text = re.sub(r"store-[0-9]+", "store-?", text)
    text = re.sub(r"\[(127\.0\.0\.1|::1|localhost)\]:[0-9]+", "[host]:?", text)
    text = re.sub(r"\b[0-9]+ms\b", "?ms", text)
    return text


def tensor_digest(t) -> str:
    if t is None:
        return "None"
    if hasattr(t, "to_local"):  # DTensor: this rank's shard
        t = t.to_local()
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    # A copy: exporting the tensor's own storage to numpy makes it non-resizable, and FSDP
    # frees unsharded parameters by resizing their storage ("Trying to resize storage that
    # is not resizable" at the next reshard when a digest saw a registered unsharded parameter)
    t = t.contiguous().clone()
    data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return f"{tuple(t.shape)}:{str(t.dtype)[6:]}:{hashlib.sha1(data).hexdigest()[:16]}"


def tensor_print(t):
    """A numeric fingerprint of this rank's values of ``t`` (float64 ``[sum, l2 norm, projection]``, or
    None): what an allowlist entry that lets numbers differ by summation order compares within a
    tolerance (runner.py, ``rounding``), where the digest compares bits."""
    if t is None:
        return None
    if hasattr(t, "to_local"):
        t = t.to_local()
    t = t.detach().reshape(-1).to(torch.float64, copy=True)
    if not t.numel():
        return [0.0, 0.0, 0.0]
    weights = (torch.arange(t.numel(), dtype=torch.float64) * 0.6180339887) % 1.0 - 0.5
    return [float(t.sum()), float(t.norm()), float((t * weights).sum())]


def _describe(value):
    """(numel, dtype) of tensors in an argument, recursively for lists; None otherwise."""
    if isinstance(value, torch.Tensor):
        return [value.numel(), str(value.dtype)[6:]]
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, torch.Tensor) for v in value):
        return [[v.numel(), str(v.dtype)[6:]] for v in value]
    return None


def _group_size(group):
    try:
        return dist.get_world_size(group)
    except Exception:  # noqa: BLE001 - not a group of this rank
        return -1


class Recorder:
    """The ordered events of one rank; wraps torch.distributed while installed."""

    def __init__(self) -> None:
        self.events: list = []
        self._depth = threading.local()
        self._originals: dict = {}

    def add(self, *event) -> None:
        self.events.append(list(event))

    # ---- collectives -------------------------------------------------------
    def _wrap(self, name, fn):
        recorder = self

        def wrapper(*args, **kwargs):
            depth = getattr(recorder._depth, "n", 0)
            if depth == 0:
                recorder._record_call(name, args, kwargs)
            recorder._depth.n = depth + 1
            try:
                return fn(*args, **kwargs)
            finally:
                recorder._depth.n = depth

        wrapper.__name__ = fn.__name__
        wrapper.__qualname__ = getattr(fn, "__qualname__", fn.__name__)
        wrapper.__wrapped__ = fn
        return wrapper

    def _record_call(self, name, args, kwargs) -> None:
        if name == "batch_isend_irecv":
            ops = args[0] if args else kwargs.get("p2p_op_list", [])
            self.add("coll", name, [[self._op_name(op.op), _group_size(op.group), op.peer,
                                     *_describe(op.tensor)] for op in ops])
            return
        group = kwargs.get("group")
        if group is None:
            group = next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
        tensors = [d for d in (_describe(a) for a in list(args) + list(kwargs.values())) if d is not None]
        peer = [kwargs[k] for k in ("dst", "src", "group_dst", "group_src") if kwargs.get(k) is not None]
        if name in ("send", "recv", "isend", "irecv") and not peer and len(args) > 1:
            peer = [args[1]]
        self.add("coll", name, _group_size(group), tensors, *peer)

    def _op_name(self, op) -> str:
        return getattr(op, "__name__", str(op))

    def install(self) -> None:
        for name in COLLECTIVES:
            fn = getattr(c10d, name, None)
            if fn is None:
                continue
            self._originals[name] = fn
            wrapped = self._wrap(name, fn)
            # Both namespaces, so identity checks (``op is isend``) keep working
            setattr(c10d, name, wrapped)
            if getattr(dist, name, None) is fn:
                setattr(dist, name, wrapped)

    # ---- warnings and logs ---------------------------------------------------
    def on_warning(self, message, category, filename, lineno, file=None, line=None) -> None:
        self.add("warning", category.__name__, normalise(str(message)))


class _LogHandler(logging.Handler):
    def __init__(self, recorder: Recorder) -> None:
        super().__init__(level=logging.WARNING)
        self.recorder = recorder

    def emit(self, record) -> None:
        try:
            self.recorder.add("log", record.levelname, normalise(record.getMessage()))
        except Exception:  # noqa: BLE001
            pass


class Context:
    """What a scenario sees: its rank, the recorder and recording helpers."""

    def __init__(self, rank: int, world: int, recorder: Recorder) -> None:
        self.rank = rank
        self.world = world
        self.recorder = recorder
        self.steps = 0

    def record(self, *event) -> None:
        self.recorder.add(*event)

    def phase(self, label: str) -> None:
        self.recorder.add("phase", label)

    def tensor(self, label: str, t) -> None:
        self.recorder.add("tensor", label, tensor_digest(t), tensor_print(t))

    def reference(self, label: str, mismatch) -> None:
        """The scenario's comparison with its float64 single-process reference: ``mismatch`` is None
        (equal within tolerance) or what differs (no numbers: both torches may be wrong alike)."""
        self.recorder.add("ref", label, "ok" if mismatch is None else f"off: {mismatch}")

    def unrecorded(self):
        """A context in which collectives are not recorded (a reference check's own gathers)."""
        recorder = self.recorder

        class _Quiet:
            def __enter__(self):
                recorder._depth.n = getattr(recorder._depth, "n", 0) + 1

            def __exit__(self, *exc):
                recorder._depth.n -= 1

        return _Quiet()

    def value(self, label: str, v) -> None:
        self.recorder.add("value", label, normalise(repr(v)))

    def fsdp_state(self, label: str, model) -> None:
        """What 2.15.0's FSDP setters set, per FSDP module of ``model`` and parameter group
        (``reduce_grads``, ``all_reduce_grads``, ``reshard_after_backward``, whether a post-forward
        mesh is set): compared between the torches like any event. Where FSDPModule has the
        series' policy getter, its value must also equal the one read at the module's first call
        (the caller's policy, restored after every step): a patched-only check that records an
        event only when it fails."""
        from torch.distributed.fsdp import FSDPModule

        policies = self.__dict__.setdefault("_policies", {})
        state = {}
        for name, module in model.named_modules():
            if not isinstance(module, FSDPModule):
                continue
            try:
                groups = module._get_fsdp_state()._fsdp_param_groups
                state[name or "<root>"] = [[g.reduce_grads, g.all_reduce_grads, g.reshard_after_backward,
                                            g.post_forward_mesh_info is not None] for g in groups]
            except Exception as exc:  # noqa: BLE001 - recorded as what it is
                state[name or "<root>"] = f"{type(exc).__name__}: {normalise(str(exc))}"
            getter = getattr(module, "get_fsdp_policy", None)
            if getter is None:
                continue
            try:
                policy = repr(getter())
            except Exception as exc:  # noqa: BLE001
                policy = f"raised {type(exc).__name__}: {normalise(str(exc))}"
            first = policies.setdefault(id(module), policy)
            self.check("policy restored", policy == first, f"{label} {name or '<root>'}: {policy} vs {first}")
        self.recorder.add("fsdp_state", label, state)

    def policy_changed(self) -> None:
        """The caller changed a policy with a setter: the next ``fsdp_state`` reads the new one."""
        self.__dict__["_policies"] = {}

    def exception(self, exc: BaseException) -> None:
        """Type and message of ``exc`` and of the exceptions it was raised from."""
        chain = []
        while exc is not None and len(chain) < 4:
            chain += [type(exc).__name__, normalise(str(exc))]
            exc = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
        self.recorder.add("exception", *chain)

    def check(self, what: str, ok: bool, detail: str = "") -> None:
        """An oracle B check of a generated program: records only a failure."""
        if not ok:
            self.recorder.add("check_failed", what, normalise(detail))

    def expect(self, fn, *args, **kwargs):
        """Calls ``fn``; records ``ok`` or the exception's type and message."""
        try:
            out = fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001
            self.exception(exc)
            return None
        self.recorder.add("ok", getattr(fn, "__name__", "call"))
        return out

    def grads(self, model) -> None:
        named = list(model.named_parameters())
        self.recorder.add("grads", {n: tensor_digest(p.grad) for n, p in named},
                          {n: tensor_print(p.grad) for n, p in named})

    def params(self, model) -> None:
        named = list(model.named_parameters())
        self.recorder.add("params", {n: tensor_digest(p) for n, p in named}, {n: tensor_print(p) for n, p in named})

    def optim_step(self, model, optim) -> None:
        """Records every gradient, steps, records every parameter, zeroes the grads."""
        self.steps += 1
        self.phase(f"optimizer step {self.steps}")
        self.grads(model)
        optim.step()
        self.params(model)
        optim.zero_grad()

    def public_state(self, model) -> None:
        """Observable state 2.15.0 has: per module, sharded (DTensor) or not, and grads present."""
        state = {}
        for name, module in model.named_modules():
            direct = list(module.named_parameters(recurse=False))
            if not direct:
                continue
            state[name or "<root>"] = [
                [n, type(p).__name__, p.requires_grad, p.grad is not None] for n, p in direct
            ]
        self.recorder.add("state", state, torch.is_grad_enabled(), model.training)


def _rank_main(sc, rank: int, world: int, store_path: str, out_path: str) -> None:
    recorder = Recorder()
    outcome = "ok"
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    try:
        torch.set_num_threads(1)
        torch.manual_seed(1000 + rank)
        dist.init_process_group(
            "gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world,
            timeout=datetime.timedelta(seconds=sc.gloo_timeout),
        )
        recorder.install()
        logging.getLogger("torch").addHandler(_LogHandler(recorder))
        ctx = Context(rank, world, recorder)
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = recorder.on_warning
            sc.fn(ctx)
    except Exception as exc:  # noqa: BLE001
        outcome = "error"
        recorder.add("uncaught", type(exc).__name__, normalise(str(exc)).splitlines()[:3])
        sys.stderr.write(traceback.format_exc())
    data = {"outcome": outcome, "events": recorder.events}
    tmp = out_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, default=lambda o: normalise(repr(o)))
    os.replace(tmp, out_path)
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass


def run_scenario(sc, workdir: str, index: int) -> dict:
    store_path = os.path.join(workdir, f"store-{index}")
    log_path = os.path.join(workdir, f"{index:04d}.log")
    outs = [os.path.join(workdir, f"{index:04d}-rank{r}.json") for r in range(sc.world)]
    sys.stdout.flush()
    sys.stderr.flush()
    pids = []
    for rank in range(sc.world):
        pid = os.fork()
        if pid == 0:  # the rank
            code = 0
            try:
                fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
                os.dup2(fd, 1)
                os.dup2(fd, 2)
                _rank_main(sc, rank, sc.world, store_path, outs[rank])
            except BaseException:  # noqa: BLE001
                code = 1
            finally:
                os._exit(code)
        pids.append(pid)
    deadline = time.monotonic() + sc.timeout
    codes: dict = {}
    timed_out = False
    while len(codes) < len(pids):
        for pid in pids:
            if pid in codes:
                continue
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                codes[pid] = os.waitstatus_to_exitcode(status)
        if len(codes) < len(pids):
            if time.monotonic() > deadline:
                timed_out = True
                for pid in pids:
                    if pid not in codes:
                        try:
                            os.kill(pid, signal.SIGKILL)
                        except ProcessLookupError:
                            pass
                for pid in pids:
                    if pid not in codes:
                        codes[pid] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
                break
            time.sleep(0.005)
    ranks = []
    for rank, path in enumerate(outs):
        if os.path.exists(path):
            with open(path) as f:
                ranks.append(json.load(f))
        else:
            ranks.append({"outcome": "TIMEOUT" if timed_out else f"exit {codes[pids[rank]]}",
                          "events": []})
    return {"outcome": "TIMEOUT" if timed_out else "done", "ranks": ranks}


def program_scenarios(path: str) -> list:
    """Scenarios of generated programs: ``[{"name", "world", "source", "timeout", "gloo_timeout"}]``."""
    with open(path) as f:
        programs = json.load(f)
    out = []
    for prog in programs:
        def run(ctx, prog=prog):
            ns = {"__name__": prog["name"]}
            exec(compile(prog["source"], prog["name"], "exec"), ns)  # noqa: S102 - our own generated program
            ns["body"](ctx.rank, ctx.world, ctx)

        out.append(catalogue.Scenario(prog["name"], run, world=prog["world"], timeout=prog.get("timeout", 60.0),
                                      gloo_timeout=prog.get("gloo_timeout", 8.0)))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-k", dest="pattern", action="append", default=[],
                        help="run scenarios whose name contains any of these (repeatable)")
    parser.add_argument("--out")
    parser.add_argument("--list", action="store_true", help="print the scenario names and exit")
    parser.add_argument("--progress", type=int, default=0, help="report every N scenarios on stderr")
    parser.add_argument("--programs", help="run the generated programs of this JSON file instead of the catalogue")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    preload()
    scenarios = program_scenarios(args.programs) if args.programs else catalogue.select(args.pattern)
    if args.list:
        for sc in scenarios:
            print(f"{sc.name}  (world {sc.world})")
        print(f"{len(scenarios)} scenarios")
        return 0
    results: dict = {}
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="parity-") as workdir:
        for index, sc in enumerate(scenarios):
            t0 = time.monotonic()
            results[sc.name] = run_scenario(sc, workdir, index)
            results[sc.name]["seconds"] = round(time.monotonic() - t0, 3)
            if args.progress and (index + 1) % args.progress == 0:
                print(f"    [{torch.__version__}] {index + 1}/{len(scenarios)} scenarios, "
                      f"{time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)
            log = os.path.join(workdir, f"{index:04d}.log")
            if os.path.exists(log):
                with open(log, errors="replace") as f:
                    results[sc.name]["log_tail"] = normalise(f.read()[-2000:])
    meta = {"torch": torch.__version__, "python": sys.version.split()[0],
            "seconds": round(time.monotonic() - start, 2), "scenarios": len(scenarios)}
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "results": results}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
