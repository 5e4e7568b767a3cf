"""A CUDA program that bypasses the interposer: it loads libcuda.so.1 with dlmopen into a new
link-map namespace, where LD_PRELOAD's interposer is not, and allocates through that copy. Its
process never connects to the node daemon; only NVML's running-process list shows what it holds.

    python bypass.py BYTES    prints {"pid", "rc"} once allocated, then waits for a line on
                              stdin (or its end) and exits

`allocate(BYTES)` does the same in the calling process (tests/containers' program). Standard
library only (it also runs on the GPU machine against the real driver, and in containers).
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
from collections.abc import Callable

LM_ID_NEWLM = -1
RTLD_NOW = 2


def load_driver() -> int:
    libc = ctypes.CDLL(None)
    libc.dlmopen.restype = ctypes.c_void_p
    libc.dlmopen.argtypes = [ctypes.c_long, ctypes.c_char_p, ctypes.c_int]
    handle = libc.dlmopen(LM_ID_NEWLM, b"libcuda.so.1", RTLD_NOW)
    if not handle:
        libc.dlerror.restype = ctypes.c_char_p
        raise SystemExit(f"dlmopen(libcuda.so.1) failed: {libc.dlerror()!r}")
    return int(handle)


def entry(handle: int, name: str, *args: object) -> Callable[..., int]:
    libc = ctypes.CDLL(None)
    libc.dlsym.restype = ctypes.c_void_p
    libc.dlsym.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    address = libc.dlsym(handle, name.encode())
    if not address:
        raise SystemExit(f"no {name} in the dlmopen'ed driver")
    function: Callable[..., int] = ctypes.CFUNCTYPE(ctypes.c_int, *args)(  # type: ignore[arg-type]
        address)
    return function


def allocate(size: int) -> int:
    """cuInit, a context and cuMemAlloc of `size` through a copy of the driver of its own;
    the allocation's status (the memory stays held while the process lives)."""
    driver = load_driver()
    assert entry(driver, "cuInit", ctypes.c_uint)(0) == 0
    context = ctypes.c_void_p()
    rc = entry(driver, "cuCtxCreate_v2", ctypes.c_void_p, ctypes.c_uint, ctypes.c_int)(
        ctypes.byref(context), 0, 0)
    assert rc == 0, rc
    pointer = ctypes.c_uint64()
    return entry(driver, "cuMemAlloc_v2", ctypes.c_void_p, ctypes.c_size_t)(
        ctypes.byref(pointer), size)


def main() -> None:
    rc = allocate(int(sys.argv[1]))
    print(json.dumps({"pid": os.getpid(), "rc": rc}), flush=True)
    sys.stdin.readline()


if __name__ == "__main__":
    main()
