"""What the share benchmarks (scripts/bench-share on a GPU, scripts/bench-share-model on the
fake driver) both need: a node daemon per configuration, and results saved as they come."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
START_TIMEOUT = 15.0   # seconds; a loaded host starts Python slowly
TOKEN_RTT_CLIENT = REPO / "scripts" / "cuda" / "token_rtt.c"
TOKEN_ECHO_SERVER = REPO / "scripts" / "cuda" / "token_echo.c"


def have_gpu() -> bool:
    """nvidia-smi is there and lists a GPU; else token benchmarks run on a simulated one."""
    if shutil.which("nvidia-smi") is None:
        return False
    done = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
    return done.returncode == 0 and "GPU" in done.stdout


def build_token_rtt(out: Path) -> Path:
    """scripts/cuda/token_rtt.c, the token client in C (as the hook's), built into `out`."""
    return _build_tool(TOKEN_RTT_CLIENT, out / "token_rtt")


def build_token_echo(out: Path) -> Path:
    """scripts/cuda/token_echo.c, a C token server that decides nothing, built into `out`."""
    return _build_tool(TOKEN_ECHO_SERVER, out / "token_echo")


def _build_tool(source: Path, binary: Path) -> Path:
    if not binary.exists():
        subprocess.run(["gcc", "-O2", "-Wall", "-Wextra", "-Werror",
                        f"-I{REPO / 'vgpu_runtime' / 'hook' / 'include'}", str(source),
                        "-o", str(binary)], check=True)
    return binary


def token_rtt_in_allocation(state: Path, client: Path, count: int, hold_us: int, out: Path,
                            share: float = 0.5, simulate: bool = False,
                            handshake: bool = False,
                            spin: bool = False) -> subprocess.Popen[bytes]:
    """The C token client inside a gemini-run allocation: COUNT rounds, each holding HOLD_US;
    OUT gets "asked granted released" (CLOCK_MONOTONIC ns) per round. With `handshake` its
    stdin and stdout are pipes (see `rounds_cpu`); with `spin` it polls for each grant
    without blocking (awake when the grant comes)."""
    from vgpu_runtime import paths
    command = (f'exec "{client}" "${paths.ENV_CHANNEL_DIR}/{paths.CHANNEL_SOCKET_NAME}" '
               f'{count} {hold_us} "{out}" hello{" handshake" if handshake else ""}'
               f'{" spin" if spin else ""}')
    pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE} if handshake else {}
    return subprocess.Popen([sys.executable, "-m", "vgpu_runtime.run", "--state-dir",
                             str(state), *(["--simulate-gpus", "1"] if simulate else []),
                             "--share", str(share), "--", "sh", "-c", command], **pipes)


def cpu_ns(pid: int) -> int:
    """User + system CPU time of a process so far (/proc, clock ticks), in ns."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * 1_000_000_000 // os.sysconf("SC_CLK_TCK")


def rounds_cpu(client: subprocess.Popen[bytes], server_pid: int) -> int:
    """A client started with `handshake`: the server's CPU time over its rounds alone (not
    its connection or hello), in ns; the client is then let go."""
    assert client.stdin is not None and client.stdout is not None
    if client.stdout.readline().strip() != b"ready":
        raise RuntimeError("token_rtt did not get ready")
    before = cpu_ns(server_pid)
    client.stdin.write(b"go\n")
    client.stdin.flush()
    if client.stdout.readline().strip() != b"done":
        raise RuntimeError("token_rtt did not finish its rounds")
    used = cpu_ns(server_pid) - before
    client.stdin.write(b"bye\n")
    client.stdin.close()
    return used


def token_rounds(out: Path) -> list[tuple[int, int, int]]:
    """What token_rtt wrote: (asked, granted, released) per round."""
    rounds = []
    for line in out.read_text().splitlines():
        asked, granted, released = (int(x) for x in line.split())
        rounds.append((asked, granted, released))
    return rounds


def handoffs(rounds: list[list[tuple[int, int, int]]]) -> list[int]:
    """Per grant that directly follows another client's release: release -> grant, ns."""
    events = sorted([(r[2], 0, who) for who, rs in enumerate(rounds) for r in rs]     # releases
                    + [(r[1], 1, who) for who, rs in enumerate(rounds) for r in rs])  # grants
    found, last_release = [], None
    for at, kind, who in events:
        if kind == 0:
            last_release = (at, who)
        elif last_release is not None and last_release[1] != who:
            found.append(at - last_release[0])
            last_release = None
    return found


class Daemon:
    """gemini-daemon on the bench's state directory, with the flags of one configuration.
    Its log goes to scheduler.log beside the state directory."""

    def __init__(self, state: Path, flags: list[str]) -> None:
        self.state, self.flags = state, flags

    def __enter__(self) -> Daemon:
        self.state.mkdir(parents=True, exist_ok=True)
        self.log_path = self.state.parent / "scheduler.log"
        self.log = open(self.log_path, "a")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "vgpu_runtime.daemon", "--state-dir", str(self.state),
             "--metrics-port", "0", *self.flags],
            stdout=self.log, stderr=subprocess.STDOUT, cwd=REPO)
        sock = self.state / "scheduler.sock"
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if sock.exists():
                return self
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        self.__exit__()
        tail = self.log_path.read_text()[-2000:]
        raise RuntimeError(f"gemini-daemon {self.flags} did not start:\n{tail}")

    def __exit__(self, *_: object) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def json_save(path: Path, results: dict[str, Any]) -> None:
    """Written whole or not at all: a run killed at its time limit leaves the last good file."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(results, indent=1))
    tmp.replace(path)


def parse_mix(text: str) -> list[float]:
    """'2/3/5' -> [0.2, 0.3, 0.5]: slices of 10, positive, adding up to at most 10."""
    try:
        shares = [int(x) / 10 for x in text.split("/")]
    except ValueError:
        raise SystemExit(f"a mix is slices of 10 such as 3/7, not {text!r}") from None
    if not shares or min(shares) <= 0 or sum(shares) > 1.0 + 1e-9:
        raise SystemExit(f"mix {text!r} must be positive slices adding up to at most 10")
    return shares


def profile_table(profiles: dict[str, dict[str, int]]) -> str:
    """Per case of a run with the hook's profiling build (its GEMINI_HOOK_STATS counters,
    launch/profile.h): launches by entry point, and per launch the median ns before, in and
    after the driver's call (the means beside them take in preemptions); `ns_per_launch` (what
    the program measured) where a case has it."""
    lines = ["| case (profiling build) | ns/launch | launches by entry point | before driver ns: "
             "median (mean) | driver ns | after driver ns |", "|---|---|---|---|---|---|"]
    for name, stats in profiles.items():
        counts = {key.removeprefix("profile_launches_"): value for key, value in stats.items()
                  if key.startswith("profile_launches_") and value}
        total = sum(counts.values()) or 1
        cells = [f"{stats.get(f'profile_{part}_p50_ps', 0) / 1000:.1f} "
                 f"({stats.get(f'profile_{part}_ns', 0) / total:.1f})"
                 for part in ("before_driver", "driver", "after_driver")]
        shown = ", ".join(f"{entry} {count}" for entry, count in counts.items()) or "none"
        lines.append(f"| {name} | {stats.get('ns_per_launch', '-')} | {shown} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


class Mps:
    """An MPS control daemon with its pipe and log directories under /tmp."""

    def __enter__(self) -> Mps:
        self.env = {"CUDA_MPS_PIPE_DIRECTORY": tempfile.mkdtemp(prefix="mps-pipe-"),
                    "CUDA_MPS_LOG_DIRECTORY": tempfile.mkdtemp(prefix="mps-log-")}
        os.environ.update(self.env)
        subprocess.run(["nvidia-cuda-mps-control", "-d"], check=True)
        time.sleep(1)
        return self

    def __exit__(self, *_: object) -> None:
        subprocess.run(["nvidia-cuda-mps-control"], input="quit\n", text=True, check=False)
        time.sleep(2)
        for key in self.env:
            os.environ.pop(key, None)
