"""tests/gpu holds CPU tests too (the replay script generator, the replay with simulated GPUs).

tests/conftest.py skips items whose *keywords* contain "gpu", and every item under this
directory has that keyword (the package is named gpu), marked or not. Until it checks the
marker instead (item.get_closest_marker("gpu")), this hook, running after it, takes its skip
back from the tests here that carry no gpu marker.
"""

from __future__ import annotations

import pytest

GPU_SKIP_REASON = "needs an NVIDIA GPU (marked gpu)"


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = config.rootpath / "tests" / "gpu"
    for item in items:
        if item.path.is_relative_to(here) and item.get_closest_marker("gpu") is None:
            item.own_markers[:] = [m for m in item.own_markers
                                   if not (m.name == "skip"
                                           and m.kwargs.get("reason") == GPU_SKIP_REASON)]
