"""A script of scripts/ (no .py name) loaded as a module, for tests of its functions."""

from __future__ import annotations

import importlib.machinery
import importlib.util
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def load(name: str, register: Callable[[str, ModuleType], None] | None = None) -> ModuleType:
    """scripts/NAME as the module NAME with dashes as underscores, given to `register` before
    it runs (to put it in sys.modules, where its dataclasses need to find it)."""
    module_name = name.replace("-", "_")
    loader = importlib.machinery.SourceFileLoader(module_name, str(SCRIPTS / name))
    spec = importlib.util.spec_from_loader(module_name, loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    if register is not None:
        register(module_name, module)
    loader.exec_module(module)
    return module
