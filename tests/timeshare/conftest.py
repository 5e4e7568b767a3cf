"""Both implementations of the token scheduler: Python (policy.TokenScheduler) and C
(nativepolicy.NativeTokenScheduler) make the same promises, so the algorithm's tests run on each."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.timeshare import sim
from vgpu_runtime.timeshare.nativepolicy import NativeTokenScheduler
from vgpu_runtime.timeshare.policy import TokenScheduler

IMPLEMENTATIONS = {"python": TokenScheduler, "native": NativeTokenScheduler}


@pytest.fixture(scope="module", params=list(IMPLEMENTATIONS))
def each_implementation(request: pytest.FixtureRequest) -> Iterator[type]:
    """The test's module and the simulation build their TokenScheduler from this class
    (module-scoped, so hypothesis's tests may use it: it is the same for every example)."""
    scheduler = IMPLEMENTATIONS[request.param]
    modules = (sim, request.module)
    saved = [module.TokenScheduler for module in modules]
    for module in modules:
        module.TokenScheduler = scheduler
    try:
        yield scheduler
    finally:
        for module, original in zip(modules, saved, strict=True):
            module.TokenScheduler = original
