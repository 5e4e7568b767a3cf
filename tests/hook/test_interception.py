"""Every way a program reaches the driver goes through the hook, and only what it hooks."""

from __future__ import annotations

import textwrap
from pathlib import Path

from tests.hook.conftest import Hooked, compile_program

# No daemon: launches pass ungated at once (GPU time fails open after the wait, here none).
ACTIVE = {"GEMINI_CHANNEL_DIR": "/nonexistent-gemini-channel", "GEMINI_HOOK_DAEMON_WAIT": "0"}

LINKED_PROGRAM = r"""
    #include <stdio.h>
    #include "cuda_types.h"
    CUresult cuInit(unsigned int);
    CUresult cuLaunchKernel(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned,
                            unsigned, unsigned, CUstream, void **, void **);
    CUresult cuLaunchKernelEx(const CUlaunchConfig *, CUfunction, void **, void **);
    CUresult cuDeviceGetName(char *, int, CUdevice);
    unsigned long fake_cuda_calls(const char *);
    int main(void) {
        char name[64];
        cuInit(0);
        for (int i = 0; i < 5; i++) cuLaunchKernel(0, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0);
        CUlaunchConfig config = {0};
        cuLaunchKernelEx(&config, 0, 0, 0);
        cuDeviceGetName(name, sizeof name, 0);
        printf("%lu %lu %s\n", fake_cuda_calls("cuLaunchKernel"),
               fake_cuda_calls("cuLaunchKernelEx"), name);
        return 0;
    }
"""


def test_link_time_binding_reaches_the_wrappers(hooked: Hooked, tmp_path: Path) -> None:
    program = compile_program(LINKED_PROGRAM, tmp_path / "linked", hooked.fake,
                              f"-L{hooked.fake}", "-lcuda")
    stats = tmp_path / "stats"
    proc = hooked.run([str(program)], {**ACTIVE, "GEMINI_HOOK_STATS": str(stats)})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["5", "1", "Fake", "GPU", "0"]   # the real driver ran
    counters = dict(line.split("=") for line in stats.read_text().split())
    assert counters["kernel_launches"] == "6"                     # ...behind the gate
    assert counters["wrapped_by_dlsym"] == "0"                    # bound at load, not dlsym


def test_without_the_hook_the_program_runs_and_nothing_is_counted(
        hooked: Hooked, tmp_path: Path) -> None:
    program = compile_program(LINKED_PROGRAM, tmp_path / "linked", hooked.fake,
                              f"-L{hooked.fake}", "-lcuda")
    stats = tmp_path / "stats"
    proc = hooked.run([str(program)], {**ACTIVE, "GEMINI_HOOK_STATS": str(stats)}, preload=False)
    assert proc.returncode == 0 and proc.stdout.split()[:2] == ["5", "1"]
    assert not stats.exists()


def test_dlopen_and_dlsym_get_wrappers_for_hooked_names_only(hooked: Hooked) -> None:
    result = hooked.python("""
        lib = cuda()
        lib.cuInit(0)
        hook = ctypes.CDLL(os.environ["GEMINI_TEST_HOOK"])
        def addr(l, name): return ctypes.cast(getattr(l, name), ctypes.c_void_p).value
        wrapped = addr(lib, "cuLaunchKernel") == addr(hook, "cuLaunchKernel")
        plain = addr(lib, "cuDeviceGetName") != addr(hook, "cuMemAlloc_v2")
        for _ in range(3):
            lib.cuLaunchKernel(None, 1, 1, 1, 1, 1, 1, 0, None, None, None)
        print(json.dumps({"wrapped": wrapped, "plain": plain, "stats": stats(),
                          "real_launches": calls(lib, "cuLaunchKernel")}))
    """, ACTIVE)
    assert result["wrapped"] and result["plain"]
    assert result["real_launches"] == 3
    stats = result["stats"]
    assert isinstance(stats, dict)
    assert stats["kernel_launches"] == 3 and stats["wrapped_by_dlsym"] >= 1


PROCADDRESS = """
    lib = cuda()
    lib.cuInit(0)
    hook = ctypes.CDLL(os.environ["GEMINI_TEST_HOOK"])
    def addr(l, name): return ctypes.cast(getattr(l, name), ctypes.c_void_p).value
    real = ctypes.CDLL("libcuda.so.1", mode=os.RTLD_NOLOAD)
    # The driver's own pointers, unwrapped: dlsym of the fake through its real handle would be
    # wrapped, so ask the fake's resolver for them with the hook out of the way.
    def resolve(fn, name, version, flags):
        out = ctypes.c_void_p()
        if fn == "v2":
            status = ctypes.c_int(-1)
            rc = lib.cuGetProcAddress_v2(name.encode(), ctypes.byref(out), version,
                                         ctypes.c_uint64(flags), ctypes.byref(status))
        else:
            rc = lib.cuGetProcAddress(name.encode(), ctypes.byref(out), version,
                                      ctypes.c_uint64(flags))
        return rc, out.value
    answers = {}
    for fn in ("v1", "v2"):
        for name, version, flags in CASES:
            rc, ptr = resolve(fn, name, version, flags)
            hooked = [n for n in HOOKED if ptr == addr(hook, n)]
            answers[f"{fn} {name} {version} {flags}"] = [rc, hooked[0] if hooked else None]
    print(json.dumps({"answers": answers, "stats": stats()}))
"""

CASES = [
    ("cuMemAlloc", 3020, 0, "cuMemAlloc_v2"),
    ("cuMemAlloc", 2000, 0, None),                      # the 32-bit original: passes through
    ("cuMemGetInfo", 3020, 0, "cuMemGetInfo_v2"),
    ("cuMemGetInfo", 2000, 0, None),
    ("cuLaunchKernel", 4000, 0, "cuLaunchKernel"),
    ("cuLaunchKernel", 7000, 2, "cuLaunchKernel_ptsz"),
    ("cuLaunchKernelEx", 11060, 0, "cuLaunchKernelEx"),
    ("cuLaunchKernelEx", 11060, 2, "cuLaunchKernelEx_ptsz"),
    ("cuGraphLaunch", 10000, 2, "cuGraphLaunch_ptsz"),
    ("cuMemAllocAsync", 11020, 0, "cuMemAllocAsync"),
    ("cuMemAllocAsync", 11020, 2, "cuMemAllocAsync_ptsz"),
    ("cuMemAllocFromPoolAsync", 11020, 2, "cuMemAllocFromPoolAsync_ptsz"),
    ("cuStreamBeginCapture", 10010, 0, "cuStreamBeginCapture_v2"),
    ("cuGetProcAddress", 11030, 0, "cuGetProcAddress"),
    ("cuGetProcAddress", 12000, 0, "cuGetProcAddress_v2"),
    ("cuGetExportTable", 3000, 0, None),
    ("cuDeviceGetName", 2000, 0, None),
    ("cuDeviceTotalMem", 3020, 0, "cuDeviceTotalMem_v2"),
    ("cuCtxSynchronize", 12000, 0, "cuCtxSynchronize"),
    ("cuCtxSynchronize", 13000, 0, "cuCtxSynchronize_v2"),   # what CUDA 13's runtime asks for
]
HOOKED = sorted({c[3] for c in CASES if c[3]})


def test_cuGetProcAddress_returns_the_wrapper_of_exactly_the_driver_variant(
        hooked: Hooked) -> None:
    header = f"CASES = {[c[:3] for c in CASES]!r}\nHOOKED = {HOOKED!r}\n"
    code = header + textwrap.dedent(PROCADDRESS)
    result = hooked.python(code, ACTIVE)
    answers = result["answers"]
    assert isinstance(answers, dict)
    for fn in ("v1", "v2"):
        for name, version, flags, expected in CASES:
            assert answers[f"{fn} {name} {version} {flags}"] == [0, expected], (fn, name, version)


def test_procaddress_wrappers_are_live_and_export_table_passes_through(hooked: Hooked) -> None:
    result = hooked.python("""
        lib = cuda()
        lib.cuInit(0)
        fn = ctypes.c_void_p()
        status = ctypes.c_int()
        lib.cuGetProcAddress_v2(b"cuLaunchKernel", ctypes.byref(fn), 12000, ctypes.c_uint64(2),
                                ctypes.byref(status))
        LAUNCH = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, *[ctypes.c_uint] * 7,
                                  ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)
        launch = LAUNCH(fn.value)
        for _ in range(4): launch(None, 1, 1, 1, 1, 1, 1, 0, None, None, None)
        table = ctypes.c_void_p()
        lib.cuGetProcAddress(b"cuGetExportTable", ctypes.byref(fn), 3000, ctypes.c_uint64(0))
        EXPORT = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
        EXPORT(fn.value)(ctypes.byref(table), None)
        first = ctypes.cast(table, ctypes.POINTER(ctypes.c_int))[0]
        print(json.dumps({"ptsz": calls(lib, "cuLaunchKernel_ptsz"), "stats": stats(),
                          "export": first, "export_calls": calls(lib, "cuGetExportTable")}))
    """, ACTIVE)
    assert result["ptsz"] == 4
    stats = result["stats"]
    assert isinstance(stats, dict) and stats["kernel_launches"] == 4
    assert stats["wrapped_by_procaddress"] >= 1
    assert result["export"] == 0x5EC7E7 and result["export_calls"] == 1


RTLD_NEXT_LIB = r"""
    #define _GNU_SOURCE
    #include <dlfcn.h>
    #include <stdlib.h>
    #include <string.h>
    /* An interposer of its own (like a tracer): finds the next getenv and strlen after it. */
    static char *(*next_getenv)(const char *);
    char *getenv(const char *name) {
        if (!next_getenv) next_getenv = (char *(*)(const char *))dlsym(RTLD_NEXT, "getenv");
        if (strcmp(name, "TRACER_PROBE") == 0) return "intercepted";
        return next_getenv(name);
    }
    const char *tracer_next_self(void) {
        /* RTLD_NEXT from here must not find this library's own getenv. */
        void *next = dlsym(RTLD_NEXT, "getenv");
        return next == (void *)&getenv ? "self" : next == NULL ? "null" : "libc";
    }
"""

RTLD_NEXT_MAIN = r"""
    #include <stdio.h>
    #include <stdlib.h>
    const char *tracer_next_self(void);
    int main(void) {
        printf("%s %s %s\n", getenv("TRACER_PROBE"), getenv("HOME") ? "home" : "nohome",
               tracer_next_self());
        return 0;
    }
"""


def test_rtld_next_from_another_library_resolves_relative_to_its_caller(
        hooked: Hooked, tmp_path: Path) -> None:
    tracer = tmp_path / "libtracer.so"
    compile_program(RTLD_NEXT_LIB, tracer, hooked.fake, "-shared", "-fPIC", "-ldl")
    main = compile_program(RTLD_NEXT_MAIN, tmp_path / "main", hooked.fake,
                           f"-L{tmp_path}", "-ltracer", f"-Wl,-rpath,{tmp_path}")
    for preload in (False, True):
        proc = hooked.run([str(main)], {"HOME": "/root"}, preload=preload)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.split() == ["intercepted", "home", "libc"], (preload, proc.stdout)


def test_inactive_hook_passes_everything_through(hooked: Hooked) -> None:
    result = hooked.python("""
        lib = cuda()
        ctx = context(lib)
        rc, ptr = alloc(lib, 1 << 30)
        lib.cuLaunchKernel(None, 1, 1, 1, 1, 1, 1, 0, None, None, None)
        print(json.dumps({"rc": rc, "info": mem_info(lib), "stats": stats()}))
    """, {"GEMINI_HOOK_DEBUG": "1", "FAKE_CUDA_TOTAL_MEM": str(4 << 30)})
    assert result["rc"] == 0
    assert result["info"] == [3 << 30, 4 << 30]
    stats = result["stats"]
    assert isinstance(stats, dict)
    assert stats["active"] == 0 and stats["kernel_launches"] == 0 and stats["daemon_connects"] == 0
