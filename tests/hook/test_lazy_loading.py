"""Lazy loading (CUDA_MODULE_LOADING=LAZY, the driver's default since CUDA 12.2): a library takes
its device memory in a context at its first launch there, not when it is loaded, where the hook
measures. The fake driver does the same. The hook charges a library's globals when it is loaded
(read from the image, reserved first), so they count before they exist; the rest (the code, and
globals of an image it cannot read) appears at the first launch, on no call the hook measures,
and is charged by NVML reconciliation: the process's figure less what it declared becomes its
context charge at the next reading, so later allocations see it. The daemon reads the fake
NVML's figures (tests/security/test_unhooked_processes.py's node).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest

from tests.daemon.helpers import make_record, wait_for, wait_served
from tests.hook.conftest import PRELUDE, Hooked
from tests.security.test_unhooked_processes import UUID, Node, start_node, stop_node

GiB, MiB = 1 << 30, 1 << 20
CONTEXT, GLOBALS, CODE = 64 * MiB, 400 * MiB, 300 * MiB
OOM = 2

PROGRAM = """
import sys
lib = cuda()
context(lib)
lib.fake_cuda_used_bytes.restype = ctypes.c_ulonglong
ptx = (b".version 7.0\\n.target sm_70\\n.address_size 64\\n"
       b".visible .global .align 8 .b8 big[%d];\\n"
       b".visible .entry touch() { ret; }\\n\\0" % (400 << 20))
library = ctypes.c_void_p()
rc = lib.cuLibraryLoadData(ctypes.byref(library), ptx, None, None, 0, None, None, 0)
print(json.dumps({"rc": rc, "driver_holds": lib.fake_cuda_used_bytes(0)}), flush=True)
sys.stdin.readline()
lib.cuLaunchKernel(None, 1, 1, 1, 1, 1, 1, 0, None, None, None)
print(json.dumps({"driver_holds": lib.fake_cuda_used_bytes(0)}), flush=True)
sys.stdin.readline()
print(json.dumps({"rc": alloc(lib, 300 << 20)[0]}), flush=True)
sys.stdin.readline()
"""


@pytest.fixture
def node(hooked: Hooked) -> Iterator[Node]:
    started = start_node(hooked)
    yield started
    stop_node(started)


def test_a_lazily_loaded_library_is_charged_before_and_after_its_first_launch(
        node: Node) -> None:
    record = make_record(node.state_dir, gpus=((UUID, GiB, 0.5),))
    wait_served(record)
    env = {**node.driver_env(), "GEMINI_CHANNEL_DIR": record.channel_dir,
           "CUDA_MODULE_LOADING": "LAZY", "FAKE_CUDA_MODULE_BYTES": str(CODE)}
    proc = subprocess.Popen([sys.executable, "-c", PRELUDE + textwrap.dedent(PROGRAM)],
                            env=node.hooked.env(env), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        loaded = Hooked.line(proc)
        # Loaded: the driver holds only the context; the globals are charged already.
        assert loaded["rc"] == 0 and loaded["driver_holds"] == CONTEXT, loaded
        wait_for(lambda: node.gpu(record)["memory_used"] >= GLOBALS, 5, "the globals charged")
        launched = Hooked.line(proc, go=True)
        assert launched["driver_holds"] == CONTEXT + GLOBALS + CODE, launched
        # The first launch took the code too: charged within a reading or two.
        wait_for(lambda: node.gpu(record)["memory_used"] == CONTEXT + GLOBALS + CODE, 5,
                 f"the lazy load charged (used {node.gpu(record)['memory_used'] >> 20} MiB)")
        refused = Hooked.line(proc, go=True)
        assert refused["rc"] == OOM, refused   # 764 + 300 MiB > 1 GiB; granted uncharged
        assert node.gpu(record)["over_limit"] is None
    finally:
        if proc.poll() is None:
            proc.communicate("\n", timeout=10)
    assert proc.returncode == 0, proc.stderr.read() if proc.stderr else ""
