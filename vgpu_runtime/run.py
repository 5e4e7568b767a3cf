"""gemini-run: GPU sharing without Kubernetes.

    gemini-run [--gpu INDEX|UUID] [--share F] [--limit F] [--memory SIZE] [--state-dir DIR]
               [--overcommit] [--simulate-gpus N] -- COMMAND...

It writes an allocation record (origin "gemini-run") the way the device plugin's Allocate does,
starts the node daemon in the background if none holds the state directory's lock, waits for the
allocation's channel socket, and runs COMMAND with the interposer preloaded and the channel in
its environment. When COMMAND ends (or gemini-run gets SIGTERM/SIGINT/SIGHUP) the record is
removed, which ends the allocation. Exit status, as `docker run`'s: 125 for every error of
gemini-run's own (usage included: refused admission, no GPU, no daemon, a bad flag), 126 when
COMMAND cannot be run, 127 when it is not found, else COMMAND's own (128+N if signal N killed it).
COMMAND is checked before anything else, so a typo costs no GPU discovery and no daemon.

Admission: the shares of the live records on the chosen GPU (both origins) plus the new one must
not pass 1.0, unless --overcommit. Admissions by concurrent gemini-run commands are serialised by
an flock on <state-dir>/run.lock; the device plugin does not take it, so a kubelet allocation
racing a gemini-run on the same GPU can still overcommit (on a Kubernetes node gemini-run
allocations are outside kubelet's accounting anyway).

State directory: it must be this user's alone (root's may be read by others, not written; a
user's is 0700), or gemini-run refuses it; files in it are opened without following links, and
nothing is removed but <state-dir>/channels/<id> directories of this user (securedir.py).

Stale records: a gemini-run that was SIGKILLed cannot remove its record. The next gemini-run on
the same state directory removes records whose owner process is gone (or whose pid now belongs
to a process started after the record: pid reuse). The daemon does not do it, because it may run
in another pid namespace than the gemini-run commands and could not tell who is alive.

Signals: SIGTERM, SIGHUP and a SIGINT sent with kill() are forwarded to COMMAND. A Ctrl-C typed
at the terminal already reaches COMMAND (same process group), so it is not sent twice.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import importlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import vgpu_runtime
from vgpu_runtime import allocation, containerenv, paths
from vgpu_runtime.allocation import AllocationRecord, GpuShare
from vgpu_runtime.common import cli, securedir
from vgpu_runtime.common.sizes import format_size, parse_fraction, parse_size
from vgpu_runtime.daemon import lock as daemon_lock
from vgpu_runtime.gpus import DiscoveryError, GpuInfo
from vgpu_runtime.gpus.nvml import NvmlBackend
from vgpu_runtime.gpus.simulated import SimulatedBackend

PROG = "gemini-run"
ENV_STATE_DIR = paths.ENV_STATE_DIR
ENV_SIMULATE = "GEMINI_SIMULATE_GPUS"
ENV_HOOK_LIBRARY = "GEMINI_HOOK_LIBRARY"
RUN_LOCK_NAME = paths.RUN_LOCK_NAME
DAEMON_LOG_NAME = "scheduler.log"
DAEMON_START_TIMEOUT = 15.0
DAEMON_IDLE_EXIT = 600.0   # seconds the daemon started here outlives the last allocation
SHARE_EPSILON = 1e-9
CHILD_POLL_INTERVAL = 1.0
SI_KERNEL = 0x80  # si_code of a signal the kernel raised itself (e.g. Ctrl-C at a terminal)
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
WATCHED = {*FORWARDED, signal.SIGCHLD}


EXIT_OWN_ERROR = 125     # docker run's codes: gemini-run's own error,
EXIT_CANNOT_RUN = 126    # COMMAND exists but cannot be run,
EXIT_NOT_FOUND = 127     # COMMAND is not found.


class RunError(Exception):
    """Something stops gemini-run before COMMAND starts; the message says what to do."""

    def __init__(self, message: str, status: int = EXIT_OWN_ERROR) -> None:
        super().__init__(message)
        self.status = status


class _Parser(argparse.ArgumentParser):
    """Usage errors exit 125 like every other error of gemini-run's own (argparse says 2)."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(EXIT_OWN_ERROR, f"{self.prog}: error: {message}\n")


@dataclass(frozen=True)
class Request:
    gpu: str | None
    share: float
    limit: float | None
    memory: int | None
    state_dir: Path
    overcommit: bool
    simulate_gpus: int | None
    hook_library: str | None
    command: list[str]


def _fraction(text: str) -> float:
    """The pod annotations' grammar: 0.3 or 30%."""
    try:
        return parse_fraction(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _size(text: str) -> int:
    """A memory limit: a size above 0 (0 would refuse every allocation)."""
    try:
        size = parse_size(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    if size <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be more than 0")
    return size


def _count(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive number of GPUs, got {text!r}")
    return int(text)


def parse_args(argv: Sequence[str] | None = None) -> Request:
    parser = _Parser(
        prog=PROG, description="Run COMMAND on a share of a GPU, without Kubernetes.",
        usage="gemini-run [options] -- COMMAND...")
    cli.add_version(parser)
    parser.add_argument("--gpu", metavar="INDEX|UUID",
                        help="GPU index or UUID (default: the first with room)")
    parser.add_argument("--share", type=_fraction, default=1.0, metavar="F",
                        help="guaranteed share of GPU time, in (0, 1] (default 1)")
    parser.add_argument("--limit", type=_fraction, default=None, metavar="F",
                        help="cap on the GPU-time share (default: the node default)")
    parser.add_argument("--memory", type=_size, default=None, metavar="SIZE",
                        help="memory limit such as 8GiB (default: share x GPU memory)")
    parser.add_argument("--state-dir", default=None, metavar="DIR",
                        help=f"state directory (env {ENV_STATE_DIR}; default "
                             f"{paths.default_state_dir()})")
    parser.add_argument("--overcommit", action="store_true",
                        help="allow the shares on the GPU to add up to more than 1.0")
    parser.add_argument("--simulate-gpus", type=_count, default=None, metavar="N",
                        help=f"use N simulated GPUs instead of NVML (env {ENV_SIMULATE})")
    parser.add_argument("--hook-library", default=None, metavar="PATH",
                        help=f"interposer to preload (env {ENV_HOOK_LIBRARY}; default: the "
                             "installed versioned library)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND...")
    args = parser.parse_args(argv)
    command = list(args.command)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        parser.error("no COMMAND given: gemini-run [options] -- COMMAND...")
    simulate = args.simulate_gpus
    if simulate is None and os.environ.get(ENV_SIMULATE):
        try:
            simulate = _count(os.environ[ENV_SIMULATE])
        except argparse.ArgumentTypeError as err:
            parser.error(f"{ENV_SIMULATE}: {err}")
    if args.limit is not None and args.limit < args.share:
        parser.error(f"--limit {args.limit:g} is below --share {args.share:g}: the cap on a "
                     "share cannot be less than the share guaranteed")
    state_dir = args.state_dir or os.environ.get(ENV_STATE_DIR) or paths.default_state_dir()
    return Request(
        gpu=args.gpu, share=args.share, limit=args.limit, memory=args.memory,
        state_dir=Path(state_dir), overcommit=args.overcommit, simulate_gpus=simulate,
        hook_library=args.hook_library or os.environ.get(ENV_HOOK_LIBRARY), command=command)


def check_command(command: list[str]) -> None:
    """COMMAND must be found (127) and be runnable (126) before a GPU is looked for."""
    name = command[0]
    if "/" in name:
        path = Path(name)
        if not path.exists():
            raise RunError(f"{name}: no such file", EXIT_NOT_FOUND)
    else:
        found = shutil.which(name)
        if found is None:
            raise RunError(f"{name}: command not found in PATH", EXIT_NOT_FOUND)
        path = Path(found)
    # Effective ids, as exec uses: access()'s real-id check ignores capabilities.
    if path.is_dir() or not os.access(path, os.X_OK, effective_ids=True):
        raise RunError(f"{name}: cannot be run (not an executable file)", EXIT_CANNOT_RUN)


# ---- GPUs ----

def discover(request: Request) -> list[GpuInfo]:
    if request.simulate_gpus:
        return SimulatedBackend(request.simulate_gpus).discover()
    try:
        gpus = NvmlBackend().discover()
    except DiscoveryError as err:
        raise RunError(str(err)) from None
    if not gpus:
        raise RunError("NVML found no usable GPU; use --simulate-gpus N to run without one")
    return gpus


def shares_in_use(state_dir: Path, uuid: str) -> list[tuple[AllocationRecord, float]]:
    used = []
    for _path, record in allocation.scan_records(state_dir):
        if isinstance(record, AllocationRecord):
            used += [(record, g.share) for g in record.gpus if g.uuid == uuid]
    return used


def choose_gpu(gpus: list[GpuInfo], wanted: str | None, state_dir: Path, share: float) -> GpuInfo:
    if wanted is not None:
        for gpu in gpus:
            if wanted in (str(gpu.index), gpu.uuid):
                return gpu
        known = ", ".join(f"{g.index} ({g.uuid})" for g in gpus)
        raise RunError(f"no GPU {wanted!r} on this machine; known: {known}")
    for gpu in gpus:
        if sum(s for _, s in shares_in_use(state_dir, gpu.uuid)) + share <= 1 + SHARE_EPSILON:
            return gpu
    return gpus[0]  # none has room: the admission check explains


def admit(state_dir: Path, gpu: GpuInfo, share: float, overcommit: bool) -> None:
    in_use = shares_in_use(state_dir, gpu.uuid)
    total = sum(s for _, s in in_use)
    if total + share <= 1 + SHARE_EPSILON or overcommit:
        return
    holders = "; ".join(f"{r.id} ({r.origin}" + (f", pid {r.owner_pid}" if r.owner_pid else "")
                        + _pod_note(state_dir, r) + f"): {s:g}" for r, s in in_use)
    raise RunError(
        f"GPU {gpu.index} ({gpu.uuid}) has {max(0.0, 1 - total):g} of its time free and "
        f"--share {share:g} was asked; in use: {holders}. Ask for a smaller --share, another "
        "--gpu, or pass --overcommit.")


# ---- stale records ----

def _pod_note(state_dir: Path, record: AllocationRecord) -> str:
    binding = allocation.load_binding(state_dir, record.id) or record.carried
    return f", pod {binding.pod.namespace}/{binding.pod.name}" if binding else ""


def _boot_time() -> float | None:
    with contextlib.suppress(OSError, ValueError), open("/proc/stat") as handle:
        for line in handle:
            if line.startswith("btime "):
                return float(line.split()[1])
    return None


def process_start_time(pid: int) -> float | None:
    """When `pid` started (seconds since the epoch), or None when it cannot be told."""
    boot = _boot_time()
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    if boot is None or len(fields) < 20:
        return None
    return boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")


def owner_alive(record: AllocationRecord) -> bool:
    pid = record.owner_pid
    if not pid:
        return True  # nothing to judge by: keep it
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's live process
    started = process_start_time(pid)
    # Start times are in clock ticks since boot: allow a second of rounding.
    return started is None or started <= record.created_at + 1


def clean_stale(state_dir: Path) -> list[str]:
    removed = []
    for _path, record in allocation.scan_records(state_dir):
        if (isinstance(record, AllocationRecord) and record.origin == "gemini-run"
                and not owner_alive(record)):
            allocation.end_allocation(state_dir, record.id, record)
            removed.append(record.id)
    return removed


# ---- state directory, admission lock, daemon ----

def prepare_state_dir(state_dir: Path) -> None:
    """Create the state directory, or check one that exists: it must be this user's alone (root's
    may be read by others), or another user could plant links and records in it that make this
    run truncate, append to or delete the user's files."""
    uid = os.geteuid()
    try:
        state_dir.mkdir(parents=True, exist_ok=True, mode=securedir.allowed_mode(uid))
        securedir.check_owned_dir(state_dir, uid)
        allocations = paths.allocations_dir(state_dir)
        with contextlib.suppress(FileExistsError):
            allocations.mkdir(mode=0o755)
        securedir.check_owned_dir(allocations, uid, mode=0o755)
        securedir.make_dir(paths.channels_dir(state_dir), paths.CHANNELS_DIR_MODE)
    except securedir.InsecureDirectory as err:
        fix = ("chown root:root it and chmod go-w it" if uid == 0 else
               "if it is yours, chmod 0700 it; else remove it (check what it holds first: "
               "another user made it)")
        raise RunError(f"refusing state directory {state_dir}: {err}. Another user could plant "
                       f"files in it. Fix: {fix}, or pass --state-dir DIR naming a directory of "
                       "your own") from None
    except OSError as err:
        raise RunError(f"cannot use state directory {state_dir}: {err.strerror}; pass "
                       "--state-dir DIR") from None


@contextlib.contextmanager
def admission_lock(state_dir: Path) -> Iterator[None]:
    fd = securedir.open_nofollow(state_dir / RUN_LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _unblock_signals() -> None:
    signal.pthread_sigmask(signal.SIG_UNBLOCK, WATCHED)


def ensure_daemon(state_dir: Path, simulate_gpus: int | None) -> subprocess.Popen[bytes] | None:
    """Start gemini-daemon detached (new session) unless one holds the lock already."""
    if daemon_lock.is_held(state_dir):
        return None
    package_root = str(Path(vgpu_runtime.__file__).resolve().parents[1])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    log_fd = securedir.open_nofollow(state_dir / DAEMON_LOG_NAME,
                                     os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    # The daemon sees the GPUs gemini-run sees (gemini-vgpu status lists them).
    simulate = ["--simulate-gpus", str(simulate_gpus)] if simulate_gpus else []
    with open(log_fd, "ab") as log, open(os.devnull, "rb") as devnull:
        # A second daemon started by a racing gemini-run exits at once on the lock: harmless.
        return subprocess.Popen(
            # No metrics port: a node's own daemon may hold 9401 already.
            [sys.executable, "-m", "vgpu_runtime.daemon", "--state-dir", str(state_dir),
             "--metrics-port", "0", "--idle-exit", f"{DAEMON_IDLE_EXIT:g}", *simulate],
            stdin=devnull, stdout=log, stderr=log, cwd="/", env=env, start_new_session=True,
            preexec_fn=_unblock_signals)


def wait_for_channel(record: AllocationRecord, daemon: subprocess.Popen[bytes] | None,
                     request: Request) -> None:
    state_dir = request.state_dir
    socket_path = paths.channel_socket(record.channel_dir)
    deadline = time.monotonic() + DAEMON_START_TIMEOUT
    while not socket_path.exists():
        pending = signal.sigtimedwait(FORWARDED, 0)
        if pending is not None:
            raise Interrupted(pending.si_signo)
        if daemon is None and not daemon_lock.is_held(state_dir):
            # The running daemon exited (idle_exit) before it saw the record: start one.
            daemon = ensure_daemon(state_dir, request.simulate_gpus)
        if daemon is not None and daemon.poll() is not None and not daemon_lock.is_held(
                state_dir):
            raise RunError(f"gemini-daemon exited with status {daemon.returncode}; see "
                           f"{state_dir / DAEMON_LOG_NAME}")
        if time.monotonic() > deadline:
            raise RunError(f"no channel socket {socket_path} after {DAEMON_START_TIMEOUT:g}s: is "
                           f"gemini-daemon serving {state_dir}? See "
                           f"{state_dir / DAEMON_LOG_NAME}")
        time.sleep(0.02)


class Interrupted(Exception):
    def __init__(self, signo: int) -> None:
        super().__init__(signo)
        self.signo = signo


# ---- running the command ----

def hook_library_path(request: Request) -> Path:
    if request.hook_library:
        path = Path(request.hook_library)
    else:
        try:
            hooklib = importlib.import_module("vgpu_runtime.hooklib")
        except ImportError as err:
            raise RunError(f"the interposer is not available ({err}); build it or pass "
                           "--hook-library PATH") from None
        path = Path(hooklib.library_path())
    if not path.is_file():
        raise RunError(f"interposer library {path} does not exist")
    return path.resolve()


def child_environment(record: AllocationRecord, library: Path) -> dict[str, str]:
    env = dict(os.environ)
    preload = env.get("LD_PRELOAD")
    env["LD_PRELOAD"] = f"{library}:{preload}" if preload else str(library)
    env.update(containerenv.container_environment(record, record.channel_dir))
    return env


def supervise(command: list[str], env: dict[str, str]) -> int:
    """Run COMMAND, forwarding signals (they are blocked here and read with sigwaitinfo)."""
    try:
        child = subprocess.Popen(command, env=env, preexec_fn=_unblock_signals)
    except OSError as err:
        cli.error(PROG, f"cannot run {command[0]}: {err.strerror}")
        return EXIT_NOT_FOUND if isinstance(err, FileNotFoundError) else EXIT_CANNOT_RUN
    while child.poll() is None:
        # Timed, so that a SIGCHLD that never comes (a parent that ignored it) costs a poll
        # interval, not a hang.
        info = signal.sigtimedwait(WATCHED, CHILD_POLL_INTERVAL)
        if info is None or info.si_signo == signal.SIGCHLD:
            continue
        from_terminal = info.si_signo == signal.SIGINT and info.si_code == SI_KERNEL
        if not from_terminal:
            with contextlib.suppress(ProcessLookupError):
                child.send_signal(info.si_signo)
    code = child.returncode
    return code if code >= 0 else 128 - code


def build_record(request: Request, gpu: GpuInfo, library: Path) -> AllocationRecord:
    allocation_id = allocation.new_run_id()
    memory = (request.memory if request.memory is not None
              else containerenv.entitled_memory(gpu.memory_total, 0, request.share))
    if memory > gpu.memory_total and not request.overcommit:
        raise RunError(f"--memory {format_size(memory)} is more than GPU {gpu.index} has "
                       f"({format_size(gpu.memory_total)}); pass --overcommit to allow it")
    channel = paths.channel_dir(request.state_dir, allocation_id)
    if not paths.fits_unix_socket(paths.channel_socket(channel)):
        raise RunError(f"state directory {request.state_dir} is too deep: the channel socket "
                       f"path must fit in {paths.UNIX_PATH_MAX} bytes")
    return AllocationRecord(
        id=allocation_id, origin="gemini-run", device_ids=(),
        gpus=(GpuShare(uuid=gpu.uuid, index=gpu.index, share=request.share,
                       memory_limit=memory),),
        channel_dir=str(channel), hook_library=library.name, created_at=time.time(),
        limit=request.limit, owner_pid=os.getpid())


def run(request: Request) -> int:
    check_command(request.command)
    library = hook_library_path(request)
    gpus = discover(request)
    prepare_state_dir(request.state_dir)
    # An ignored SIGCHLD is inherited across exec (some supervisors set it): children would be
    # reaped by the kernel, and COMMAND's exit status lost. gemini-run waits for its own.
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    # Block the signals before the record exists, so that no signal can leave it behind.
    signal.pthread_sigmask(signal.SIG_BLOCK, WATCHED)
    record: AllocationRecord | None = None
    try:
        with admission_lock(request.state_dir):
            clean_stale(request.state_dir)
            gpu = choose_gpu(gpus, request.gpu, request.state_dir, request.share)
            admit(request.state_dir, gpu, request.share, request.overcommit)
            record = build_record(request, gpu, library)
            Path(record.channel_dir).mkdir(mode=0o700)
            allocation.write_record(request.state_dir, record)
        daemon = ensure_daemon(request.state_dir, request.simulate_gpus)
        wait_for_channel(record, daemon, request)
        return supervise(request.command, child_environment(record, library))
    except Interrupted as stop:
        return 128 + stop.signo
    finally:
        if record is not None:
            allocation.end_allocation(request.state_dir, record.id, record)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, WATCHED)


def main(argv: Sequence[str] | None = None) -> int:
    request = parse_args(argv)
    try:
        return run(request)
    except RunError as err:
        cli.error(PROG, str(err))
        return err.status
    except allocation.RecordError as err:
        cli.error(PROG, str(err))
        return EXIT_OWN_ERROR
    except OSError as err:   # e.g. a link where the lock or the log file goes (ELOOP)
        cli.error(PROG, f"{err}; check the state directory")
        return EXIT_OWN_ERROR


if __name__ == "__main__":
    sys.exit(main())
