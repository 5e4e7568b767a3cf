"""Memory the driver reserves outside allocation calls (RELIABILITY.md, A1-A3), attacked through the
fake libcuda, which reserves it as the real driver does: context limits, module and library
loads, graph memory nodes added by hand. And the legacy launches, which run kernels.

Each attack is refused with CUDA_ERROR_OUT_OF_MEMORY and leaves the device as it was, or is
charged to the container while it fits. The fake's own accounting (fake_cuda_used_bytes) says
what the driver really reserved."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.hook.conftest import PRELUDE, DaemonNode, GiB, Hooked, MiB
from tests.hook.images import REAL_CUBIN, REAL_LZ4_FATBIN, REAL_ZSTD_FATBIN, cubin, fatbin, ptx

OOM = 2
STACK, PRINTF_FIFO, MALLOC_HEAP, PENDING_LAUNCHES = 0, 1, 2, 4
H200 = {"FAKE_CUDA_TOTAL_MEM": str(141 * GiB), "FAKE_CUDA_SMS": "132"}

SETUP = """
    lib = cuda()
    lib.fake_cuda_used_bytes.restype = ctypes.c_ulonglong
    def used():
        return lib.fake_cuda_used_bytes(0)
    def set_limit(which, value):
        return lib.cuCtxSetLimit(which, ctypes.c_size_t(value))
    def get_limit(which):
        value = ctypes.c_size_t()
        assert lib.cuCtxGetLimit(ctypes.byref(value), which) == 0
        return value.value
    def held():
        return stats()["bytes_held"]
    ctx = context(lib)
"""


def run(hooked: Hooked, node: DaemonNode, body: str, prefix: str = "",
        **env: str) -> dict[str, object]:
    source = textwrap.dedent(SETUP) + textwrap.dedent(prefix) + textwrap.dedent(body)
    return hooked.python(source, node.env(**env))


# ---- A1, A3: context limits ----

def test_a_stack_limit_past_the_memory_limit_is_refused_before_the_driver_reserves_it(
        hooked: Hooked, node: DaemonNode) -> None:
    """A1: 256 KiB of stack is 256 KiB x 132 SMs x 2048 threads = 66 GiB on an H200."""
    result = run(hooked, node, """
        before = used()
        out = {"rc": set_limit(0, 256 << 10), "reserved": used() - before,
               "driver_calls": calls(lib, "cuCtxSetLimit"), "stack": get_limit(0),
               "held": held(), "after": alloc(lib, 900 << 20)[0]}
        print(json.dumps(out))
    """, **H200)
    assert result["rc"] == OOM
    assert result["reserved"] == 0 and result["driver_calls"] == 0   # never reached the driver
    assert result["stack"] == 1024                                    # the default stands
    assert result["held"] == 0 and result["after"] == 0               # nothing charged


def test_a_stack_limit_that_fits_is_charged_until_lowered_or_its_context_goes(
        hooked: Hooked, node: DaemonNode) -> None:
    result = run(hooked, node, """
        out = {"rc": set_limit(0, 16 << 10), "held": held()}     # 16 KiB x 4 SMs x 2048 = 128 MiB
        out["over"] = alloc(lib, 950 << 20)[0]                   # 120 + 950 > 1024
        out["fits"], ptr = alloc(lib, 800 << 20)
        lib.cuMemFree_v2(ctypes.c_uint64(ptr))
        out["lowered"] = set_limit(0, 1024)
        out["held_lowered"] = held()                             # the default: the context's
        out["raised"] = set_limit(0, 32 << 10)
        out["held_raised"] = held()
        out["destroyed"] = lib.cuCtxDestroy_v2(ctx)
        out["held_after_destroy"] = held()
        print(json.dumps(out))
    """, FAKE_CUDA_SMS="4")
    # Charged above what the default 1 KiB holds (8 MiB here), which the context's charge has.
    assert result["rc"] == 0 and result["held"] == 120 * MiB
    assert result["over"] == OOM and result["fits"] == 0
    assert result["lowered"] == 0 and result["held_lowered"] == 0
    assert result["raised"] == 0 and result["held_raised"] == 248 * MiB
    assert result["destroyed"] == 0 and result["held_after_destroy"] == 0


@pytest.mark.parametrize("limit", [MALLOC_HEAP, PRINTF_FIFO], ids=["malloc_heap", "printf_fifo"])
def test_heap_and_printf_fifo_limits_are_charged_and_refused_past_the_limit(
        hooked: Hooked, node: DaemonNode, limit: int) -> None:
    """A3: both reserve their value."""
    result = run(hooked, node, f"""
        before = used()
        out = {{"big": set_limit({limit}, 4 << 30), "reserved_big": used() - before,
               "held_big": held()}}
        out["small"] = set_limit({limit}, 300 << 20)
        out["held_small"] = held()
        out["over"] = alloc(lib, 800 << 20)[0]                   # 292 or 299 + 800 > 1024
        print(json.dumps(out))
    """)
    assert result["big"] == OOM and result["reserved_big"] == 0 and result["held_big"] == 0
    default = {MALLOC_HEAP: 8 * MiB, PRINTF_FIFO: 1 * MiB}[limit]   # the context's already
    assert result["small"] == 0 and result["held_small"] == 300 * MiB - default
    assert result["over"] == OOM


def test_a_heap_reserved_at_the_next_launch_is_charged_when_set_and_uncharged_when_set_back(
        hooked: Hooked, node: DaemonNode) -> None:
    """As on the H100 (2026-12-05): a raised heap takes nothing until a launch, so setting it
    back frees nothing measurable; the charge still falls back to the old value's."""
    result = run(hooked, node, """
        before = used()
        out = {"set": set_limit(2, 300 << 20), "reserved": used() - before, "held": held()}
        out["back"] = set_limit(2, 8 << 20)
        out["held_back"] = held()
        out["again"] = set_limit(2, 300 << 20)
        lib.cuLaunchKernel(None, 1, 1, 1, 1, 1, 1, 0, None, None, None)
        out["reserved_launched"] = used() - before
        out["held_launched"] = held()
        out["back_launched"] = set_limit(2, 8 << 20)
        out["reserved_end"], out["held_end"] = used() - before, held()
        print(json.dumps(out))
    """)
    assert result["set"] == 0 and result["reserved"] == 0 and result["held"] == 292 * MiB
    assert result["back"] == 0 and result["held_back"] == 0
    assert result["again"] == 0 and result["reserved_launched"] == 292 * MiB
    assert result["held_launched"] == 292 * MiB
    assert result["back_launched"] == 0
    assert result["reserved_end"] == 0 and result["held_end"] == 0


def test_a_stack_that_takes_more_than_its_rule_keeps_its_measured_excess_when_lowered(
        hooked: Hooked, node: DaemonNode) -> None:
    """The driver reports 4 SMs and reserves for 8: each value is charged what it took, up
    and down, not what the rule says."""
    result = run(hooked, node, """
        before = used()
        out = {"up": set_limit(0, 16 << 10)}
        out["taken_up"], out["held_up"] = used() - before, held()
        out["down"] = set_limit(0, 8 << 10)
        out["taken_down"], out["held_down"] = used() - before, held()
        out["default"] = set_limit(0, 1024)
        out["taken_default"], out["held_default"] = used() - before, held()
        print(json.dumps(out))
    """, FAKE_CUDA_SMS="8", FAKE_CUDA_REPORTED_SMS="4")
    # 16 KiB x 8 x 2048 = 256 MiB, less the default 1 KiB's 16 MiB the context holds.
    assert result["up"] == 0 and result["taken_up"] == result["held_up"] == 240 * MiB
    assert result["down"] == 0 and result["taken_down"] == result["held_down"] == 112 * MiB
    assert result["default"] == 0 and result["taken_default"] == result["held_default"] == 0


def test_a_limit_that_takes_more_than_its_rule_is_measured_and_set_back(
        hooked: Hooked, node: DaemonNode) -> None:
    """The driver reports 1 SM but reserves for 132: the rule lets the call through, the
    measurement catches what it took, and the old value comes back."""
    result = run(hooked, node, """
        before = used()
        out = {"rc": set_limit(0, 16 << 10), "left": used() - before, "stack": get_limit(0),
               "held": held(), "driver_calls": calls(lib, "cuCtxSetLimit")}
        print(json.dumps(out))
    """, FAKE_CUDA_SMS="132", FAKE_CUDA_REPORTED_SMS="1")   # 16 KiB x 132 x 2048 = 4.1 GiB
    assert result["rc"] == OOM
    assert result["driver_calls"] == 2            # set, then set back
    assert result["stack"] == 1024 and result["left"] == 0 and result["held"] == 0


def test_limits_without_memory_pass_through_uncharged(hooked: Hooked, node: DaemonNode) -> None:
    result = run(hooked, node, """
        out = {"rc": set_limit(6, 4 << 30), "held": held()}   # persisting L2: cache, not memory
        print(json.dumps(out))
    """)
    assert result == {"rc": 0, "held": 0}


def test_cuGetProcAddress_hands_out_the_charging_cuCtxSetLimit(
        hooked: Hooked, node: DaemonNode) -> None:
    """The CUDA runtime (cudaDeviceSetLimit) reaches the driver through cuGetProcAddress."""
    result = run(hooked, node, """
        fn = ctypes.c_void_p()
        assert lib.cuGetProcAddress(b"cuCtxSetLimit", ctypes.byref(fn), 12000, 0) == 0
        proto = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.c_size_t)
        before = used()
        out = {"rc": proto(fn.value)(0, 256 << 10), "reserved": used() - before}
        print(json.dumps(out))
    """, **H200)
    assert result == {"rc": OOM, "reserved": 0}


# ---- A2, A3: modules and libraries ----

LOAD = """
    import base64
    image = base64.b64decode(sys.argv[1]) if len(sys.argv) > 1 else None
    module = ctypes.c_void_p()
"""


def load(hooked: Hooked, node: DaemonNode, image: bytes, body: str,
         **env: str) -> dict[str, object]:
    source = PRELUDE + "import sys\n" + textwrap.dedent(SETUP) + textwrap.dedent(LOAD) + \
        textwrap.dedent(body)
    proc = subprocess.run([sys.executable, "-c", source, base64.b64encode(image).decode()],
                          env=hooked.env(node.env(**env)), capture_output=True, text=True,
                          timeout=30)
    assert proc.returncode == 0, proc.stderr
    result: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def test_a_module_whose_globals_pass_the_limit_is_refused_before_loading(
        hooked: Hooked, node: DaemonNode) -> None:
    """A2: a PTX module with a 4 GiB `.global` array."""
    result = load(hooked, node, ptx(("big", ".b8", 4 * GiB)), """
        before = used()
        out = {"rc": lib.cuModuleLoadData(ctypes.byref(module), image),
               "module": module.value, "reserved": used() - before,
               "driver_calls": calls(lib, "cuModuleLoadData"), "held": held()}
        print(json.dumps(out))
    """)
    assert result["rc"] == OOM and result["module"] is None
    assert result["driver_calls"] == 0 and result["reserved"] == 0 and result["held"] == 0


def test_a_module_that_fits_is_charged_until_unloaded(hooked: Hooked, node: DaemonNode) -> None:
    result = load(hooked, node, ptx(("a", ".f32", 50 * MiB), ("b", ".v4 .u8", 25 * MiB)), """
        out = {"rc": lib.cuModuleLoadDataEx(ctypes.byref(module), image, 0, None, None),
               "held": held()}
        out["over"] = alloc(lib, 800 << 20)[0]                   # 300 + 800 > 1024
        out["unload"] = lib.cuModuleUnload(module)
        out["held_after"] = held()
        out["fits"] = alloc(lib, 800 << 20)[0]
        print(json.dumps(out))
    """)
    # .f32 x 50 Mi = 200 MiB; the fake knows no vectors (25 MiB), the hook reads .v4 (100 MiB):
    # the charge is the larger of what was read and what was measured.
    assert result["rc"] == 0 and result["held"] == 300 * MiB
    assert result["over"] == OOM
    assert result["unload"] == 0 and result["held_after"] == 0 and result["fits"] == 0


def test_an_image_the_hook_cannot_read_is_measured_and_unloaded_past_the_limit(
        hooked: Hooked, node: DaemonNode) -> None:
    """A compressed fatbin hides its globals until the driver loads it: the measurement then
    decides, uncapped."""
    result = load(hooked, node, b"FAKEBIN 4294967296\0", """
        before = used()
        out = {"rc": lib.cuModuleLoadFatBinary(ctypes.byref(module), image),
               "left": used() - before, "held": held(),
               "loads": calls(lib, "cuModuleLoadFatBinary"),
               "unloads": calls(lib, "cuModuleUnload")}
        print(json.dumps(out))
    """)
    assert result["rc"] == OOM and result["loads"] == 1 and result["unloads"] == 1
    assert result["left"] == 0 and result["held"] == 0


@pytest.mark.parametrize("form", ["cubin", "cubin_section", "ptxas_cubin", "fatbin",
                                  "fatbin_ptxas_cubin", "fatbin_ptx", "fatbin_lz4",
                                  "fatbin_zstd"])
def test_cubin_and_fatbin_globals_are_read_before_loading(
        hooked: Hooked, node: DaemonNode, form: str) -> None:
    """The fake driver cannot read these formats and reserves nothing for them: only the hook's
    own reading of the image refuses them."""
    # ptxas_cubin: what ptxas 12.9 made of tests/hook/data/global-4gib.ptx (`ptxas
    # -arch=sm_90`): its `.nv.global` is empty, the 4 GiB is in the symbol `big`.
    image = {"cubin": cubin(4 * GiB), "cubin_section": cubin(4 * GiB, in_symbol=False),
             "ptxas_cubin": REAL_CUBIN.read_bytes(),
             "fatbin": fatbin((2, cubin(4 * GiB), 0)),
             "fatbin_ptxas_cubin": fatbin((2, REAL_CUBIN.read_bytes(), 0)),
             "fatbin_ptx": fatbin((1, ptx(("big", ".u64", GiB // 2)), 0)),
             # nvFatbin 12.9's default compression (LZ4) of that cubin (-compress-all).
             "fatbin_lz4": REAL_LZ4_FATBIN.read_bytes(),
             # -compress-mode=size: zstd, unpacked through the system's libzstd.
             "fatbin_zstd": REAL_ZSTD_FATBIN.read_bytes()}[form]
    result = load(hooked, node, image, """
        out = {"rc": lib.cuModuleLoadData(ctypes.byref(module), image),
               "driver_calls": calls(lib, "cuModuleLoadData")}
        print(json.dumps(out))
    """)
    assert result == {"rc": OOM, "driver_calls": 0}


@pytest.mark.parametrize("form", ["zstd_corrupt", "lz4_unsized", "lz4_corrupt"])
def test_a_compressed_entry_the_hook_cannot_unpack_is_charged_as_measured(
        hooked: Hooked, node: DaemonNode, form: str) -> None:
    """Compressed entries the hook cannot unpack: a damaged zstd frame, an LZ4 entry whose
    header gives no packed size, and one whose block is damaged. Read as not understood, so
    loaded and measured (the fake reserves nothing for fatbins): charged nothing, not refused,
    and the hook survives the bad data."""
    real = REAL_LZ4_FATBIN.read_bytes()
    zstd = REAL_ZSTD_FATBIN.read_bytes()
    image = {"zstd_corrupt": zstd[:0x58 + 40] + b"\xff" * (len(zstd) - 0x58 - 40),
             "lz4_unsized": fatbin((2, cubin(4 * GiB), 0x2000)),
             "lz4_corrupt": real[:0x58 + 40] + b"\xff" * (len(real) - 0x58 - 40)}[form]
    result = load(hooked, node, image, """
        out = {"rc": lib.cuModuleLoadData(ctypes.byref(module), image), "held": held()}
        print(json.dumps(out))
    """)
    assert result == {"rc": 0, "held": 0}


def test_module_and_library_files_and_library_data_are_charged(
        hooked: Hooked, node: DaemonNode, tmp_path: Path) -> None:
    big = tmp_path / "big.ptx"
    big.write_bytes(ptx(("big", ".b8", 4 * GiB)))
    opaque = tmp_path / "opaque.bin"
    opaque.write_bytes(b"FAKEBIN 4294967296\0")
    result = load(hooked, node, ptx(("big", ".b32", GiB)), f"""
        library = ctypes.c_void_p()
        before = used()
        out = {{"module_file": lib.cuModuleLoad(ctypes.byref(module), b"{big}"),
               "library_file": lib.cuLibraryLoadFromFile(ctypes.byref(library), b"{big}", None,
                                                         None, 0, None, None, 0),
               "library_opaque": lib.cuLibraryLoadFromFile(ctypes.byref(library), b"{opaque}",
                                                           None, None, 0, None, None, 0),
               "library_data": lib.cuLibraryLoadData(ctypes.byref(library), image, None, None, 0,
                                                     None, None, 0),
               "left": used() - before, "held": held()}}
        print(json.dumps(out))
    """)
    assert result == {"module_file": OOM, "library_file": OOM, "library_opaque": OOM,
                      "library_data": OOM, "left": 0, "held": 0}


# ---- A3: graph memory nodes added by hand ----

GRAPH = """
    class Location(ctypes.Structure):
        _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]
    class PoolProps(ctypes.Structure):
        _fields_ = [("allocType", ctypes.c_int), ("handleTypes", ctypes.c_int),
                    ("location", Location), ("win32", ctypes.c_void_p),
                    ("maxSize", ctypes.c_size_t), ("usage", ctypes.c_ushort),
                    ("reserved", ctypes.c_ubyte * 54)]
    class Params(ctypes.Structure):
        _fields_ = [("poolProps", PoolProps), ("accessDescs", ctypes.c_void_p),
                    ("accessDescCount", ctypes.c_size_t), ("bytesize", ctypes.c_size_t),
                    ("dptr", ctypes.c_uint64)]
    assert ctypes.sizeof(PoolProps) == 88 and ctypes.sizeof(Params) == 120
    def graph_exec(size):
        graph, node, exe = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
        assert lib.cuGraphCreate(ctypes.byref(graph), 0) == 0
        params = Params(bytesize=size)
        params.poolProps.allocType = 1
        params.poolProps.location = Location(1, 0)
        assert lib.cuGraphAddMemAllocNode(ctypes.byref(node), graph, None, 0,
                                          ctypes.byref(params)) == 0
        assert lib.cuGraphInstantiateWithFlags(ctypes.byref(exe), graph,
                                               ctypes.c_ulonglong(0)) == 0
        return exe
"""


def test_a_graph_whose_memory_nodes_pass_the_limit_is_refused_at_launch_and_upload(
        hooked: Hooked, node: DaemonNode) -> None:
    result = run(hooked, node, prefix=GRAPH, body="""
        big = graph_exec(4 << 30)
        before = used()
        out = {"upload": lib.cuGraphUpload(big, None), "launch": lib.cuGraphLaunch(big, None),
               "launch_ptsz": lib.cuGraphLaunch_ptsz(big, None), "reserved": used() - before,
               "launches": calls(lib, "cuGraphLaunch") + calls(lib, "cuGraphLaunch_ptsz")}
        small = graph_exec(300 << 20)
        out["small"] = lib.cuGraphLaunch(small, None)
        out["again"] = lib.cuGraphLaunch(small, None)
        out["graph_held"] = held()
        out["over"] = alloc(lib, 800 << 20)[0]
        print(json.dumps(out))
    """)
    assert result["upload"] == OOM and result["launch"] == OOM and result["launch_ptsz"] == OOM
    assert result["reserved"] == 0 and result["launches"] == 0
    assert result["small"] == 0 and result["again"] == 0
    assert result["graph_held"] == 300 * MiB and result["over"] == OOM


def test_graph_memory_is_checked_against_what_the_container_holds(
        hooked: Hooked, node: DaemonNode) -> None:
    result = run(hooked, node, prefix=GRAPH, body="""
        rc, ptr = alloc(lib, 800 << 20)
        exe = graph_exec(300 << 20)
        out = {"alloc": rc, "launch_with_800": lib.cuGraphLaunch(exe, None)}
        lib.cuMemFree_v2(ctypes.c_uint64(ptr))
        out["launch_after_free"] = lib.cuGraphLaunch(exe, None)
        print(json.dumps(out))
    """)
    assert result == {"alloc": 0, "launch_with_800": OOM, "launch_after_free": 0}


# ---- A3: legacy launches ----

def test_legacy_launches_go_through_the_gate(hooked: Hooked) -> None:
    result = hooked.python("""
        lib = cuda()
        context(lib)
        lib.cuLaunch(None)
        lib.cuLaunchGrid(None, 4, 4)
        lib.cuLaunchGridAsync(None, 4, 4, ctypes.c_void_p(0x77))
        class LaunchParams(ctypes.Structure):
            _fields_ = [("function", ctypes.c_void_p), ("dims", ctypes.c_uint * 7),
                        ("stream", ctypes.c_void_p), ("params", ctypes.c_void_p)]
        launches = (LaunchParams * 1)(LaunchParams(stream=0x78))
        lib.cuLaunchCooperativeKernelMultiDevice(launches, 1, 0)
        names = ["cuLaunch", "cuLaunchGrid", "cuLaunchGridAsync",
                 "cuLaunchCooperativeKernelMultiDevice"]
        print(json.dumps({"real": [calls(lib, n) for n in names], "stats": stats()}))
    """, {"GEMINI_CHANNEL_DIR": "/nonexistent-gemini-channel", "GEMINI_HOOK_DAEMON_WAIT": "0"})
    assert result["real"] == [1, 1, 1, 1]
    stats = result["stats"]
    assert isinstance(stats, dict) and stats["kernel_launches"] == 4


@pytest.mark.parametrize("call", ["cuLaunch(None)", "cuLaunchGrid(None, 2, 2)",
                                  "cuLaunchGridAsync(None, 2, 2, ctypes.c_void_p(0x77))"])
def test_a_legacy_launch_waits_for_the_token(hooked: Hooked, node: DaemonNode, call: str) -> None:
    """Share 0.5: the first launch asks the daemon for the token; later ones ride the grant."""
    result = hooked.python(f"""
        lib = cuda()
        context(lib)
        for _ in range(50):
            lib.{call}
        print(json.dumps(stats()))
    """, node.env())
    assert result["kernel_launches"] == 50
    assert result["token_requests"] >= 1


def test_the_primary_contexts_last_release_takes_its_limits_and_modules_charges(
        hooked: Hooked, node: DaemonNode) -> None:
    result = load(hooked, node, ptx(("g", ".b8", 200 * MiB)), """
        lib.cuCtxDestroy_v2(ctx)                                # only the primary context now
        primary = ctypes.c_void_p()
        assert lib.cuDevicePrimaryCtxRetain(ctypes.byref(primary), 0) == 0
        assert lib.cuCtxSetCurrent(primary) == 0
        out = {"heap": set_limit(2, 100 << 20),
               "module": lib.cuModuleLoadData(ctypes.byref(module), image), "held": held()}
        out["release"] = lib.cuDevicePrimaryCtxRelease_v2(0)
        out["held_after"] = held()
        print(json.dumps(out))
    """)
    assert result["heap"] == 0 and result["module"] == 0
    assert result["held"] == 92 * MiB + 200 * MiB             # heap above its 8 MiB default
    assert result["release"] == 0 and result["held_after"] == 0


def test_a_library_that_fits_is_charged_to_the_current_context_until_unloaded(
        hooked: Hooked, node: DaemonNode) -> None:
    result = load(hooked, node, ptx(("g", ".b16", 100 * MiB)), """
        library = ctypes.c_void_p()
        out = {"rc": lib.cuLibraryLoadData(ctypes.byref(library), image, None, None, 0, None,
                                           None, 0), "held": held()}
        out["unload"] = lib.cuLibraryUnload(library)
        out["held_after"] = held()
        print(json.dumps(out))
    """)
    assert result == {"rc": 0, "held": 200 * MiB, "unload": 0, "held_after": 0}
