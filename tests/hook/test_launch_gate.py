"""Every launch entry point goes through the one gate; captured launches are not gated."""

from __future__ import annotations

from tests.hook.conftest import Hooked

# Launches need no daemon; contexts ask for the allocation, so do not wait for one.
ACTIVE = {"GEMINI_CHANNEL_DIR": "/nonexistent-gemini-channel", "GEMINI_HOOK_DAEMON_WAIT": "0"}


def test_every_launch_variant_is_counted_once(hooked: Hooked) -> None:
    result = hooked.python("""
        lib = cuda()
        context(lib)
        k = (None, 1, 1, 1, 1, 1, 1, 0, None)
        class Config(ctypes.Structure):
            _fields_ = [("dims", ctypes.c_uint * 7), ("stream", ctypes.c_void_p),
                        ("attrs", ctypes.c_void_p), ("n", ctypes.c_uint)]
        config = Config()
        lib.cuLaunchKernel(*k, None, None)
        lib.cuLaunchKernel_ptsz(*k, None, None)
        lib.cuLaunchCooperativeKernel(*k, None)
        lib.cuLaunchCooperativeKernel_ptsz(*k, None)
        lib.cuLaunchKernelEx(ctypes.byref(config), None, None, None)
        lib.cuLaunchKernelEx_ptsz(ctypes.byref(config), None, None, None)
        lib.cuGraphLaunch(None, None)
        lib.cuGraphLaunch_ptsz(None, None)
        names = ["cuLaunchKernel", "cuLaunchKernel_ptsz", "cuLaunchCooperativeKernel",
                 "cuLaunchCooperativeKernel_ptsz", "cuLaunchKernelEx", "cuLaunchKernelEx_ptsz",
                 "cuGraphLaunch", "cuGraphLaunch_ptsz"]
        print(json.dumps({"real": [calls(lib, n) for n in names], "stats": stats()}))
    """, ACTIVE)
    assert result["real"] == [1] * 8                           # each reached its own variant
    stats = result["stats"]
    assert isinstance(stats, dict)
    assert stats["kernel_launches"] == 6 and stats["graph_launches"] == 2
    assert stats["captured_launches"] == 0 and stats["gate_ns"] > 0


def test_launches_into_a_capturing_stream_pass_straight_through(hooked: Hooked) -> None:
    result = hooked.python("""
        lib = cuda()
        context(lib)
        captured = ctypes.c_void_p(0x5eed)                     # the fake's capturing stream
        lib.cuLaunchKernel(None, 1, 1, 1, 1, 1, 1, 0, captured, None, None)
        before_capture = calls(lib, "cuStreamIsCapturing")
        lib.cuStreamBeginCapture_v2(captured, 0)
        for _ in range(3):
            lib.cuLaunchKernel(None, 1, 1, 1, 1, 1, 1, 0, captured, None, None)
        lib.cuLaunchKernel(None, 1, 1, 1, 1, 1, 1, 0, None, None, None)   # another stream
        lib.cuStreamEndCapture(captured, ctypes.byref(ctypes.c_void_p()))
        lib.cuLaunchKernel(None, 1, 1, 1, 1, 1, 1, 0, captured, None, None)
        print(json.dumps({"stats": stats(), "asked_before_capture": before_capture,
                          "real": calls(lib, "cuLaunchKernel")}))
    """, ACTIVE)
    stats = result["stats"]
    assert isinstance(stats, dict)
    assert result["real"] == 6
    assert stats["captured_launches"] == 3
    assert stats["kernel_launches"] == 3                       # before, other stream, after
    assert result["asked_before_capture"] == 0                 # no capture open: no extra call
