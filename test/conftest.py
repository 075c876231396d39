"""Suite-wide pytest policy.

A skipped test under ``test/distributed/`` or ``test/consumers/`` is reported
as a FAILURE: in torch 2.15.0 ``FSDPTest`` skips every test on machines with
fewer accelerators than ranks, and a lifecycle suite that silently skips must
not look green (nor may a consumer suite whose consumer is not installed).
Tooling tests (``test/tools``) may skip normally. This file never imports
torch, so the tooling tests run without it.
"""

from pathlib import Path

import pytest

_STRICT_DIRS = tuple(Path(__file__).resolve().parent / d for d in ("distributed", "consumers"))


def _strict(path) -> bool:
    for strict_dir in _STRICT_DIRS:
        try:
            Path(str(path)).resolve().relative_to(strict_dir)
            return True
        except ValueError:
            pass
    return False


def _fail_skip(report, where: str) -> None:
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    report.outcome = "failed"
    report.longrepr = (f"{where} was SKIPPED ({reason}); skips under test/distributed/ and "
                       "test/consumers/ count as failures (see test/conftest.py)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.skipped and not hasattr(report, "wasxfail") and _strict(item.path):
        _fail_skip(report, item.nodeid)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    report = outcome.get_result()
    if report.skipped and _strict(getattr(collector, "path", "")):
        _fail_skip(report, report.nodeid or str(collector.path))
