"""Options of the CPU suite.

`--exhaustive` also runs the tests marked `exhaustive`: tests/test_compile.py then compiles every
kernel specialisation it knows (about 2000 NVRTC builds, tens of minutes on two cores) instead of
its representative sample. Without it those tests are deselected. `--compile-jobs N` sets how
many NVRTC compiles run at once (processes; default: one per CPU this process may use).
"""

import os

import pytest


def pytest_addoption(parser):
    group = parser.getgroup("cuflash2")
    group.addoption("--exhaustive", action="store_true", default=False,
                    help="also run the tests marked exhaustive: compile every kernel "
                         "specialisation for every CPU test architecture, not a sample")
    group.addoption("--compile-jobs", type=int, default=None, metavar="N",
                    help="NVRTC compiles tests/test_compile.py runs in parallel (default: the "
                         "number of CPUs this process may use; 1: one at a time, in-process)")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--exhaustive"):
        return
    selected, deselected = [], []
    for item in items:
        (deselected if item.get_closest_marker("exhaustive") else selected).append(item)
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = selected


@pytest.fixture(scope="session")
def compile_jobs(pytestconfig) -> int:
    jobs = pytestconfig.getoption("--compile-jobs")
    if jobs is None:
        try:
            jobs = len(os.sched_getaffinity(0))
        except AttributeError:  # not Linux
            jobs = os.cpu_count() or 1
    return max(1, jobs)
