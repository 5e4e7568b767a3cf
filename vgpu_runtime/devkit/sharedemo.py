"""gemini-demo's sharing part: two programs share one GPU and the user watches their GPU-time
shares and memory, live, converge to what they asked for, then sees an allocation past a memory
limit refused.

No GPU needed: the GPU is simulated (the daemon's --simulate-gpus) and the programs
(devkit/sharejob.py) call the fake CUDA driver (devkit/fakecuda), whose kernels of both
processes queue on one shared engine as on a time-sliced GPU. Everything else is the product:
`gemini-run` for each program, the node daemon it starts, the interposer preloaded into each.
The figures shown are the daemon's own (`gemini-vgpu status` reads the same ones).
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from vgpu_runtime import cli, hooklib
from vgpu_runtime.common.sizes import format_size
from vgpu_runtime.daemon.channel import client
from vgpu_runtime.daemon.control import control_socket
from vgpu_runtime.daemon.telemetry.rows import ContainerRow, container_rows
from vgpu_runtime.devkit.childenv import child_env
from vgpu_runtime.devkit.fakecuda.builder import build_fake_driver
from vgpu_runtime.gpus.simulated import DEFAULT_MEMORY, simulated_uuid

# (name, --share, --memory): what each program asks gemini-run for.
PROGRAMS = (("train-a", 0.3, "8GiB"), ("infer-b", 0.7, "12GiB"))
# The daemon's share window for the demo (10 s by default): shares are measured over it, so
# a shorter one shows them converge in a few seconds.
WINDOW_S = 3.0
RUN_S = 8.0
REFRESH_S = 0.5
BAR = 20
CUDA_ERROR_OUT_OF_MEMORY = 2
START_TIMEOUT = 30.0


@dataclass
class Program:
    name: str
    share: float
    memory: str
    proc: subprocess.Popen[str]
    allocation: str = ""
    limit: int = 0
    past_limit: dict[str, Any] | None = None


@dataclass(frozen=True)
class Outcome:
    """What the part saw, for its test: each program's last live figures, and its refused
    allocation past the limit (the program's answer, and the refusals the daemon counted)."""
    rows: dict[str, ContainerRow]
    refused: dict[str, dict[str, Any]]


def read_event(program: Program, timeout: float = START_TIMEOUT) -> dict[str, Any]:
    """The program's next JSON line; gemini-run's error where it exits first."""
    assert program.proc.stdout is not None
    line = program.proc.stdout.readline()
    if not line:
        err = program.proc.stderr.read() if program.proc.stderr is not None else ""
        program.proc.wait(timeout)
        said = err.strip().splitlines()   # the last line is the error (a usage line before it)
        raise RuntimeError(f"{program.name} ended (exit status {program.proc.returncode}) "
                           f"before reporting: {said[-1] if said else 'nothing said'}")
    event: dict[str, Any] = json.loads(line)
    if event.get("event") == "error":
        raise RuntimeError(f"{program.name}: {event['call']} failed with {event['rc']}")
    return event


def bar(value: float) -> str:
    filled = max(0, min(BAR, round(value * BAR)))
    return "#" * filled + "." * (BAR - filled)


def table(programs: list[Program], rows: dict[str, ContainerRow], elapsed: float) -> list[str]:
    lines = [f"  t = {elapsed:4.1f} s   GPU-time share (achieved of asked)        "
             "memory used / limit"]
    for program in programs:
        row = rows.get(program.allocation)
        if row is None:
            lines.append(f"  {program.name:<8}  (not connected yet)")
            continue
        lines.append(f"  {program.name:<8}  [{bar(row.achieved)}] {row.achieved:4.2f} of "
                     f"{row.share:4.2f}   {format_size(row.memory_used):>9} / "
                     f"{format_size(row.memory_limit)}")
    return lines


class Screen:
    """A terminal redraws the table in place; a pipe gets a table every second."""

    def __init__(self, out: IO[str]) -> None:
        self.out = out
        self.live = out.isatty()
        self.drawn = 0
        self.last_printed = float("-inf")

    def show(self, lines: list[str], elapsed: float, final: bool = False) -> None:
        if self.live:
            if self.drawn:
                self.out.write(f"\033[{self.drawn}F")
            self.out.write("".join(f"\033[2K{line}\n" for line in lines))
            self.drawn = len(lines)
        elif final or elapsed - self.last_printed >= 1.0:
            self.out.write("\n".join(lines) + "\n")
            self.last_printed = elapsed
        self.out.flush()


def start(name: str, share: float, memory: str, state_dir: Path, env: dict[str, str]
          ) -> Program:
    argv = [sys.executable, "-m", "vgpu_runtime.run", "--state-dir", str(state_dir),
            "--simulate-gpus", "1", "--gpu", "0", "--share", f"{share:g}", "--memory", memory,
            "--", sys.executable, "-m", "vgpu_runtime.devkit.sharejob", "--seconds",
            f"{RUN_S:g}"]
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd="/")
    return Program(name, share, memory, proc)


def run_sharing(root: Path, heading: Callable[[str], None], out: IO[str] = sys.stdout
                ) -> Outcome:
    heading("5. Two programs sharing one GPU, live")
    print("  gemini-run starts each program with the interposer preloaded; the node daemon it "
          "starts\n  gives out GPU time and memory. The GPU is simulated and the programs call "
          "a fake CUDA\n  driver (1 ms kernels on one shared engine), so this runs anywhere. "
          f"Shares are measured\n  over a {WINDOW_S:g} s window for the demo "
          "(GEMINI_WINDOW; 10 s by default).", file=out)
    fake = build_fake_driver(root / "fake-cuda")
    library = hooklib.library_path()
    state_dir = root / "run-state"
    locks = root / "gpu-locks"   # this demo's simulated GPU is locked here, not in /run/lock
    locks.mkdir(mode=0o700)
    env = child_env(
        LD_LIBRARY_PATH=str(fake), FAKE_CUDA_UUIDS=simulated_uuid(0),
        FAKE_CUDA_TOTAL_MEM=str(DEFAULT_MEMORY), FAKE_CUDA_ENGINE=str(root / "engine"),
        GEMINI_GPU_LOCK_DIR=str(locks), GEMINI_HOOK_LIBRARY=str(library),
        GEMINI_WINDOW=f"{WINDOW_S:g}")
    for name, share, memory in PROGRAMS:
        print(f"  $ gemini-run --share {share:g} --memory {memory} -- {name}", file=out)
    programs: list[Program] = []
    try:
        for name, share, memory in PROGRAMS:
            programs.append(start(name, share, memory, state_dir, env))
        for program in programs:
            started = read_event(program)
            program.allocation, program.limit = str(started["allocation"]), int(started["limit"])
        print(file=out)
        screen = Screen(out)
        began = time.monotonic()
        rows: dict[str, ContainerRow] = {}
        # Until just before the programs stop launching (RUN_S from their start, a moment
        # before this loop's): past that, their shares of the window fall off.
        while not any(p.proc.poll() is not None for p in programs):
            elapsed = time.monotonic() - began
            with contextlib.suppress(OSError, ValueError):
                rows = {r.allocation: r for r in container_rows(client.request(state_dir))}
            last = elapsed + REFRESH_S >= RUN_S - REFRESH_S
            screen.show(table(programs, rows, elapsed), elapsed, final=last)
            if last:
                break
            time.sleep(REFRESH_S)
        for program in programs:
            program.past_limit = read_event(program, RUN_S + START_TIMEOUT)
        # The refusals, counted while both allocations still live.
        after = {r.allocation: r for r in container_rows(client.request(state_dir))}
        print(file=out)
        for program in programs:
            seen = program.past_limit or {}
            row = after.get(program.allocation)
            answer = ("refused: CUDA_ERROR_OUT_OF_MEMORY" if seen.get("rc") ==
                      CUDA_ERROR_OUT_OF_MEMORY else f"answered {seen.get('rc')}")
            print(f"  {program.name} holds {format_size(int(seen.get('held', 0)))} of its "
                  f"{format_size(program.limit)} and asks for "
                  f"{format_size(int(seen.get('asked', 0)))} more: {answer} (the daemon counts "
                  f"{row.memory_refusals if row else '?'} refusal(s))", file=out)
        return Outcome(rows={p.name: rows[p.allocation] for p in programs
                             if p.allocation in rows},
                       refused={p.name: {**(p.past_limit or {}), "counted": after[
                           p.allocation].memory_refusals if p.allocation in after else None}
                                for p in programs})
    finally:
        for program in programs:
            if program.past_limit is None and program.proc.poll() is None:
                program.proc.terminate()   # a part cut short: gemini-run passes it on
            with contextlib.suppress(OSError, ValueError):
                if program.proc.stdin is not None:
                    program.proc.stdin.write("\n")
                    program.proc.stdin.close()
        for program in programs:
            try:
                program.proc.wait(10)
            except subprocess.TimeoutExpired:
                program.proc.kill()
                program.proc.wait()
            for stream in (program.proc.stdout, program.proc.stderr):
                if stream is not None:
                    stream.close()
        stop_daemon(state_dir, out)


def stop_daemon(state_dir: Path, out: IO[str]) -> None:
    """The daemon gemini-run started: stopped now rather than after its idle time."""
    if not control_socket(state_dir).exists():
        return
    try:
        pid = cli.stop_daemon(str(state_dir), force=False, timeout=cli.STOP_TIMEOUT)
    except cli.StatusError as err:
        print(f"  {err}", file=out)
        return
    print(f"  gemini-daemon (pid {pid}) stopped", file=out)


__all__ = ["Outcome", "run_sharing"]
