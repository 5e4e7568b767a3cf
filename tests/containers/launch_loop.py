"""The program inside the test containers: CUDA driver calls over whatever libcuda.so.1 the
container was given (the fake driver, mounted by the node's CDI spec), driven step by step.

It runs in a container that holds nothing of the project: the standard library only, and the
interposer only through LD_PRELOAD as Allocate set it. One JSON line answers each stdin line:

    facts                    uid, pid, the preloaded library, what /run/gemini holds, sockets
    init                     cuInit + a context (the first CUDA call)
    meminfo                  cuMemGetInfo: free and total
    alloc BYTES              cuMemAlloc: its status
    loop START DURATION KERNEL_NS SYNC_EVERY
                             launch/sync until START + DURATION (wall clock); counts the kernels
                             completed inside [START, START + DURATION); START "now" is when
                             the step is read (one program alone needs no common instant)
    write-attempts           every way of writing under /run/gemini, and what each gave
    forge HELLO_HEX          a hello of its own (the bytes given), then every way of writing
                             the token page it brings (forgery.py, copied next to this file)
    connect PATH             connect to a Unix socket: "ok" or the errno's name
    bypass BYTES             allocate through libcuda loaded with dlmopen, where the interposer
                             is not (bypass.py, copied next to this file): its status
    stats                    the interposer's counters (gemini_hook_stats), names from argv[1]
    quit                     exit (the hook then writes GEMINI_HOOK_STATS)
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import os
import socket
import sys
import time

STREAM = 0x5EED
CHANNEL = "/run/gemini"
PR_SET_TIMERSLACK = 29


def driver() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


def preloaded() -> list[str]:
    with open("/proc/self/maps") as maps:
        return sorted({f[5] for f in (line.split() for line in maps)
                       if len(f) >= 6 and "gemini-hook" in f[5]})


def digest(path: str) -> str:
    with open(path, "rb") as handle:
        return hashlib.sha256(handle.read()).hexdigest()


def sockets_under(top: str, skip: tuple[str, ...]) -> list[str]:
    found = []
    for directory, subdirs, files in os.walk(top):
        subdirs[:] = [d for d in subdirs if os.path.join(directory, d) not in skip]
        for name in files + subdirs:
            path = os.path.join(directory, name)
            try:
                if os.stat(path, follow_symlinks=False).st_mode & 0o170000 == 0o140000:
                    found.append(path)
            except OSError:
                pass
    return sorted(found)


def facts() -> dict[str, object]:
    libraries = preloaded()
    return {"uid": os.getuid(), "gid": os.getgid(), "pid": os.getpid(),
            "preloaded": libraries, "hook_sha256": [digest(p) for p in libraries],
            "channel": sorted(os.listdir(CHANNEL)) if os.path.isdir(CHANNEL) else None,
            "sockets": sockets_under("/", ("/proc", "/sys", "/usr", "/dev", "/etc")),
            "env": {k: v for k, v in os.environ.items() if k.startswith(("GEMINI_", "LD_"))}}


def attempt(action) -> str:
    try:
        action()
    except OSError as err:
        return errno.errorcode.get(err.errno or 0, str(err.errno))
    return "ok"


def write_attempts() -> dict[str, str]:
    entries = sorted(os.listdir(CHANNEL))
    results = {
        "create": attempt(lambda: open(os.path.join(CHANNEL, "planted"), "x").close()),
        "mkdir": attempt(lambda: os.mkdir(os.path.join(CHANNEL, "d"))),
        "symlink": attempt(lambda: os.symlink("/tmp", os.path.join(CHANNEL, "link"))),
        "bind": attempt(lambda: socket.socket(socket.AF_UNIX).bind(
            os.path.join(CHANNEL, "fake.sock"))),
    }
    for name in entries:
        path = os.path.join(CHANNEL, name)
        results[f"unlink {name}"] = attempt(lambda p=path: os.unlink(p))
        results[f"rename {name}"] = attempt(lambda p=path: os.rename(p, p + ".x"))
        results[f"chmod {name}"] = attempt(lambda p=path: os.chmod(p, 0o777))
        if os.path.isfile(path):
            results[f"open-rw {name}"] = attempt(
                lambda p=path: os.close(os.open(p, os.O_RDWR)))
            results[f"truncate {name}"] = attempt(lambda p=path: os.truncate(p, 0))
    return results


def forge(hello_hex: str) -> dict[str, object]:
    import forgery  # tests/security/forgery.py, in /app beside this program

    with socket.socket(socket.AF_UNIX) as sock:
        sock.connect(os.path.join(CHANNEL, "sched.sock"))
        sock.sendall(bytes.fromhex(hello_hex))
        _reply, fds, _flags, _addr = socket.recv_fds(sock, 4096, 16)
        try:
            results = forgery.attempts(f"/proc/self/fd/{fds[0]}", fds[0])
            return {"attempts": results, "forged": forgery.forged(fds[0]),
                    "valid_until": forgery.read_valid_until(fds[0])}
        finally:
            for fd in fds:
                os.close(fd)


def connect(path: str) -> str:
    with socket.socket(socket.AF_UNIX) as sock:
        return attempt(lambda: sock.connect(path))


class Cuda:
    def __init__(self) -> None:
        self.lib = driver()
        launch = self.lib.cuLaunchKernel
        launch.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
        self.launch_kernel = launch
        self.lib.cuStreamSynchronize.argtypes = [ctypes.c_void_p]
        self.held: list[int] = []

    def init(self) -> dict[str, object]:
        rc = self.lib.cuInit(0)
        ctx = ctypes.c_void_p()
        rc_ctx = self.lib.cuCtxCreate_v2(ctypes.byref(ctx), 0, 0)
        return {"rc": rc, "rc_ctx": rc_ctx}

    def meminfo(self) -> dict[str, object]:
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        rc = self.lib.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total))
        return {"rc": rc, "free": free.value, "total": total.value}

    def alloc(self, size: int) -> dict[str, object]:
        ptr = ctypes.c_uint64()
        rc = self.lib.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(size))
        if rc == 0:
            self.held.append(ptr.value)
        return {"rc": rc}

    def loop(self, start: float, duration: float, kernel_ns: int,
             sync_every: int) -> dict[str, object]:
        self.lib.fake_cuda_set_kernel_ns.argtypes = [ctypes.c_longlong]
        self.lib.fake_cuda_set_kernel_ns(kernel_ns)
        stream = ctypes.c_void_p(STREAM)
        failures = 0

        def step() -> None:
            nonlocal failures
            for _ in range(sync_every):
                failures += self.launch_kernel(None, 1, 1, 1, 1, 1, 1, 0, stream, None,
                                               None) != 0
            failures += self.lib.cuStreamSynchronize(stream) != 0

        while time.time() < start:
            step()
        end, kernels, launches = start + duration, 0, 0
        while True:
            step()
            launches += sync_every
            now = time.time()
            if now >= end:
                break
            kernels += sync_every
        return {"kernels": kernels, "launches": launches, "failures": failures,
                "busy": kernels * kernel_ns / 1e9 / duration}


def stats(names: list[str]) -> dict[str, int]:
    fields = [("version", ctypes.c_uint32), ("active", ctypes.c_uint32),
              ("bytes_held", ctypes.c_uint64)] + [(n, ctypes.c_uint64) for n in names]
    snapshot = type("Stats", (ctypes.Structure,), {"_fields_": fields})()
    hook = ctypes.CDLL(None)   # the preloaded interposer is in the global scope
    if hook.gemini_hook_stats(ctypes.byref(snapshot)) != 0:
        raise SystemExit("gemini_hook_stats failed")
    return {name: int(getattr(snapshot, name)) for name, _ in fields}


def main() -> None:
    names = json.loads(sys.argv[1]) if len(sys.argv) > 1 else []
    ctypes.CDLL(None).prctl(PR_SET_TIMERSLACK, 1, 0, 0, 0)
    cuda: Cuda | None = None
    print(json.dumps({"ready": True, "pid": os.getpid()}), flush=True)
    for line in sys.stdin:
        op, *args = line.split()
        if op == "quit":
            break
        if op == "facts":
            out: dict[str, object] = facts()
        elif op == "write-attempts":
            out = write_attempts()
        elif op == "forge":
            out = forge(args[0])
        elif op == "bypass":
            import bypass  # tests/security/bypass.py, in /app beside this program
            out = {"rc": bypass.allocate(int(args[0]))}
        elif op == "connect":
            out = {"result": connect(args[0])}
        elif op == "stats":
            out = stats(names)
        else:
            cuda = cuda or Cuda()
            if op == "init":
                out = cuda.init()
            elif op == "meminfo":
                out = cuda.meminfo()
            elif op == "alloc":
                out = cuda.alloc(int(args[0]))
            elif op == "loop":
                start = time.time() if args[0] == "now" else float(args[0])
                out = cuda.loop(start, float(args[1]), int(args[2]), int(args[3]))
            else:
                out = {"error": f"unknown step {op!r}"}
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
