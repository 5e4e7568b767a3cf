"""A stand-in for `nvidia-cuda-mps-control` where no GPU is, taught what the real one does
(NVIDIA's MPS documentation; checked against the H100's in tests/gpu/test_mps_gpu.py):

* `-d` starts the control daemon in the background and returns 0; it listens on `control` in
  $CUDA_MPS_PIPE_DIRECTORY (default /tmp/nvidia-mps), a socket every user may connect to, and
  logs to `control.log` in $CUDA_MPS_LOG_DIRECTORY (default /var/log/nvidia-mps). A second
  `-d` while one answers fails.
* no argument: the client. It sends each line of stdin to the daemon and prints the answers;
  where no daemon answers it says so and exits 1.
* commands: `get_server_list` (no server runs here: nothing), `quit` (the daemon exits).

    python -m vgpu_runtime.devkit.fakecuda.fake_mps_control [-d | -f]
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path


def pipe_dir() -> Path:
    return Path(os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps"))


def log_file() -> Path:
    return Path(os.environ.get("CUDA_MPS_LOG_DIRECTORY", "/var/log/nvidia-mps")) / "control.log"


def connect() -> socket.socket | None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(str(pipe_dir() / "control"))
    except OSError:
        sock.close()
        return None
    return sock


def serve() -> None:
    """The control daemon, in the foreground."""
    path = pipe_dir() / "control"
    path.unlink(missing_ok=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    # A control daemon run as root serves clients of every user (it starts each one's server
    # as that user), so its socket must take their connections.
    path.chmod(0o666)
    listener.listen()
    with open(log_file(), "a") as logf:
        print(f"[{time.ctime()}] control daemon started, pid {os.getpid()}", file=logf, flush=True)
        while True:
            conn, _ = listener.accept()
            with conn:
                command = conn.makefile().readline().strip()
                if not command:   # a probe: connected and went
                    continue
                print(f"[{time.ctime()}] {command}", file=logf, flush=True)
                if command == "quit":
                    path.unlink(missing_ok=True)
                    return
                with contextlib.suppress(OSError):   # a client gone before its answer
                    conn.sendall(b"" if command == "get_server_list" else b"unknown command\n")


def client() -> int:
    for line in sys.stdin:
        sock = connect()
        if sock is None:
            print("Cannot find MPS control daemon process", file=sys.stderr)
            return 1
        with sock:
            sock.sendall(line.encode())
            sock.shutdown(socket.SHUT_WR)
            sys.stdout.write(sock.makefile().read())
    return 0


def main() -> int:
    args = sys.argv[1:]
    if args == ["-f"]:
        serve()
        return 0
    if args == ["-d"]:
        probe = connect()
        if probe is not None:
            probe.close()
            print("An instance of this daemon is already running", file=sys.stderr)
            return 1
        daemon = subprocess.Popen([sys.executable, "-m", __spec__.name, "-f"],
                                  start_new_session=True, stdin=subprocess.DEVNULL,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(500):   # -d returns once the daemon listens, as the real one does
            probe = connect()
            if probe is not None:
                probe.close()
                return 0
            if daemon.poll() is not None:
                return 1
            time.sleep(0.01)
        return 1
    if args:
        print(f"unknown option {args[0]}", file=sys.stderr)
        return 1
    return client()


if __name__ == "__main__":
    sys.exit(main())
