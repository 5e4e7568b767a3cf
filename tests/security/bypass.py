"""A CUDA program that bypasses the interposer, one of two ways. Its process never connects to
the node daemon; only NVML's running-process list shows what it holds.

* dlmopen (the default): it loads libcuda.so.1 with dlmopen into a new link-map namespace,
  where LD_PRELOAD's interposer is not, and allocates through that copy.
* unpreloaded (`--unpreloaded`): it re-executes itself (same pid, same parent, same interpreter
  flags) with LD_PRELOAD removed from the environment and loads libcuda.so.1 with plain
  ctypes.CDLL: a process of a gemini-run command (or a pod) that drops the interposer, which
  the daemon still finds by its place in the command's process tree (or its mounts). This way
  does not depend on dlmopen, which the real driver may not survive.

    python bypass.py [--unpreloaded] BYTES
        prints {"pid", "rc", "way"} once allocated, then waits for a line on stdin (or its
        end) and exits

`allocate(BYTES)` does the dlmopen way in the calling process (tests/containers' program).
Standard library only (it also runs on the GPU machine against the real driver, and in
containers).
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
from collections.abc import Callable

LM_ID_NEWLM = -1
RTLD_NOW = 2
UNPRELOADED = "--unpreloaded"
Entry = Callable[..., int]
Driver = Callable[..., Entry]   # driver(name, *argtypes): the entry point, returning CUresult


def load_driver() -> int:
    libc = ctypes.CDLL(None)
    libc.dlmopen.restype = ctypes.c_void_p
    libc.dlmopen.argtypes = [ctypes.c_long, ctypes.c_char_p, ctypes.c_int]
    handle = libc.dlmopen(LM_ID_NEWLM, b"libcuda.so.1", RTLD_NOW)
    if not handle:
        libc.dlerror.restype = ctypes.c_char_p
        raise SystemExit(f"dlmopen(libcuda.so.1) failed: {libc.dlerror()!r}")
    return int(handle)


def entry(handle: int, name: str, *args: object) -> Entry:
    libc = ctypes.CDLL(None)
    libc.dlsym.restype = ctypes.c_void_p
    libc.dlsym.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    address = libc.dlsym(handle, name.encode())
    if not address:
        raise SystemExit(f"no {name} in the dlmopen'ed driver")
    function: Entry = ctypes.CFUNCTYPE(ctypes.c_int, *args)(  # type: ignore[arg-type]
        address)
    return function


def dlmopen_driver() -> Driver:
    handle = load_driver()
    return lambda name, *args: entry(handle, name, *args)


def linked_driver() -> Driver:
    """libcuda.so.1 as any program loads it; only where LD_PRELOAD is unset is that the
    driver itself and not the interposer in front of it."""
    if "LD_PRELOAD" in os.environ:
        raise SystemExit("the linked driver would be the interposer's: LD_PRELOAD is set")
    library = ctypes.CDLL("libcuda.so.1")

    def lookup(name: str, *args: object) -> Entry:
        function = getattr(library, name)
        function.restype = ctypes.c_int
        function.argtypes = list(args)
        return function  # type: ignore[no-any-return]
    return lookup


def allocate(size: int, driver: Driver | None = None) -> int:
    """cuInit, a context and cuMemAlloc of `size` through `driver` (a copy of the driver of
    its own, loaded with dlmopen, by default); the allocation's status (the memory stays held
    while the process lives)."""
    call = driver or dlmopen_driver()
    assert call("cuInit", ctypes.c_uint)(0) == 0
    context = ctypes.c_void_p()
    rc = call("cuCtxCreate_v2", ctypes.c_void_p, ctypes.c_uint, ctypes.c_int)(
        ctypes.byref(context), 0, 0)
    assert rc == 0, rc
    pointer = ctypes.c_uint64()
    return call("cuMemAlloc_v2", ctypes.c_void_p, ctypes.c_size_t)(ctypes.byref(pointer), size)


def drop_preload() -> None:
    """Re-execute this program as it was started (sys.orig_argv: the interpreter's flags
    too, such as -X faulthandler) without LD_PRELOAD: the interposer is never loaded."""
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def main() -> None:
    args = sys.argv[1:]
    way = "dlmopen"
    if args[:1] == [UNPRELOADED]:
        way, args = "unpreloaded", args[1:]
        if "LD_PRELOAD" in os.environ:
            drop_preload()   # does not return
    if len(args) != 1 or not args[0].isdigit():
        raise SystemExit(f"usage: bypass.py [{UNPRELOADED}] BYTES")
    rc = allocate(int(args[0]), linked_driver() if way == "unpreloaded" else None)
    print(json.dumps({"pid": os.getpid(), "rc": rc, "way": way}), flush=True)
    sys.stdin.readline()


if __name__ == "__main__":
    main()
