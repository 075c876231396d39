"""The scenario registry: every scenario the parity run executes.

A scenario is a function of a ``worker.Context`` that builds a tiny model on
its rank's process group, runs it like a user of torch 2.15.0 would (only APIs
2.15.0 has) and records what it observes through the context. The modules
``scenarios_fsdp`` and ``scenarios_pp`` register them at import.
"""

from dataclasses import dataclass
from typing import Callable


@dataclass
class Scenario:
    name: str
    fn: Callable
    world: int = 2
    timeout: float = 60.0  # seconds for the whole scenario; then its ranks are killed
    gloo_timeout: float = 8.0  # seconds a rank waits in a collective


SCENARIOS: dict = {}


def register(name: str, fn: Callable, **kwargs) -> None:
    if name in SCENARIOS:
        raise AssertionError(f"duplicate scenario {name}")
    SCENARIOS[name] = Scenario(name, fn, **kwargs)


def scenario(name: str, **kwargs):
    def deco(fn):
        register(name, fn, **kwargs)
        return fn

    return deco


def select(patterns) -> list:
    import scenarios_fsdp  # noqa: F401
    import scenarios_pp  # noqa: F401

    chosen = [s for s in SCENARIOS.values() if not patterns or any(p in s.name for p in patterns)]
    return chosen
