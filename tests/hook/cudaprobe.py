"""Helpers for programs that run UNDER the hook (in a child process, LD_PRELOAD set).

They reach the (fake) driver the way a Python program would: ctypes dlopen + dlsym, so
every call below goes through the hook's dlsym override.
"""

from __future__ import annotations

import ctypes
import os
import re
from pathlib import Path
from typing import Any

CUDA_SUCCESS = 0
CUDA_ERROR_OUT_OF_MEMORY = 2


# The counters as the hook's public header lists them (GEMINI_HOOK_COUNTERS), in struct order.
_HEADER = Path(__file__).resolve().parents[2] / "vgpu_runtime/hook/include/gemini_hook.h"
COUNTERS = re.findall(r"^\s*X\((\w+)\)", _HEADER.read_text(), re.M)


class HookStats(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("active", ctypes.c_uint32),
                ("bytes_held", ctypes.c_uint64)] + [(name, ctypes.c_uint64) for name in COUNTERS]


STAT_NAMES = [str(field[0]) for field in HookStats._fields_]


def cuda() -> Any:
    lib = ctypes.CDLL("libcuda.so.1")
    lib.fake_cuda_calls.restype = ctypes.c_ulong
    lib.fake_cuda_calls.argtypes = [ctypes.c_char_p]
    return lib


def calls(lib: Any, name: str) -> int:
    return int(lib.fake_cuda_calls(name.encode()))


def stats() -> dict[str, int]:
    hook = ctypes.CDLL(os.environ["GEMINI_TEST_HOOK"])
    out = HookStats()
    assert hook.gemini_hook_stats(ctypes.byref(out)) == 0
    return {name: int(getattr(out, name)) for name in STAT_NAMES}


def context(lib: Any, device: int = 0) -> Any:
    """cuInit + a current context on `device`."""
    assert lib.cuInit(0) == CUDA_SUCCESS
    ctx = ctypes.c_void_p()
    rc = lib.cuCtxCreate_v2(ctypes.byref(ctx), 0, device)
    assert rc == CUDA_SUCCESS, rc
    return ctx


def alloc(lib: Any, size: int) -> tuple[int, int]:
    ptr = ctypes.c_uint64()
    rc = lib.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(size))
    return rc, ptr.value


def mem_info(lib: Any) -> tuple[int, int]:
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    assert lib.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)) == CUDA_SUCCESS
    return free.value, total.value
