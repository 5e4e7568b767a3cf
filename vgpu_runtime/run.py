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

Metrics: the daemon started here serves none unless asked (--metrics-port PORT, or
GEMINI_RUN_METRICS_PORT), and then on 127.0.0.1 only. Off by default because every user of a
machine has a daemon of their own: one default port would go to whichever started first (and a
Kubernetes node's daemon holds 9401), so a port is something each user, or their administrator,
picks. A TCP port rather than a private Unix socket, because that is what Prometheus and curl
scrape; local because the figures are one user's. The daemon is shared by the user's commands
and keeps the port it was started with: a command that asks for another, or finds the port taken,
says so on stderr and runs all the same (gemini-vgpu status shows what is served).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import fcntl
import importlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import vgpu_runtime
from vgpu_runtime import gpulock, hoststate
from vgpu_runtime.common import cli, procs, securedir
from vgpu_runtime.common.sizes import format_size, parse_size
from vgpu_runtime.contracts import allocation, containerenv, paths
from vgpu_runtime.contracts.allocation import AllocationRecord, GpuShare
from vgpu_runtime.contracts.share import WHOLE, Share, ShareError, optional_json, total
from vgpu_runtime.daemon import lock as daemon_lock
from vgpu_runtime.daemon.channel import client
from vgpu_runtime.daemon.host import client as host_client
from vgpu_runtime.gpus import DiscoveryError, GpuInfo
from vgpu_runtime.gpus.nvml import NvmlBackend
from vgpu_runtime.gpus.simulated import SimulatedBackend

PROG = "gemini-run"
ENV_STATE_DIR = paths.ENV_STATE_DIR
ENV_SIMULATE = "GEMINI_SIMULATE_GPUS"
ENV_HOOK_LIBRARY = "GEMINI_HOOK_LIBRARY"
# Not the daemon's own GEMINI_METRICS_PORT: a node container may set that one, and a user's
# daemon must not take a port because an environment meant for another program names it.
ENV_METRICS_PORT = "GEMINI_RUN_METRICS_PORT"
METRICS_ADDRESS = "127.0.0.1"
RUN_LOCK_NAME = paths.RUN_LOCK_NAME
DAEMON_LOG_NAME = "scheduler.log"
DAEMON_START_TIMEOUT = 15.0
REFUSAL_POLL = 0.25        # seconds between asking a starting daemon whether it refused ours
DAEMON_IDLE_EXIT = 600.0   # seconds the daemon started here outlives the last allocation
CHILD_POLL_INTERVAL = 1.0
PR_SET_CHILD_SUBREAPER = 36
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
    share: Share
    limit: Share | None
    memory: int | None
    state_dir: Path
    overcommit: bool
    simulate_gpus: int | None
    hook_library: str | None
    command: list[str]
    state_dir_named: bool = False   # by --state-dir or GEMINI_STATE_DIR, not the default
    metrics_port: int = 0           # the daemon started here serves /metrics there; 0: none


def _share(text: str) -> Share:
    """The pod annotations' grammar: 0.3 or 30%."""
    try:
        return Share.parse(text)
    except ShareError as err:
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


def _port(text: str) -> int:
    if not text.isdigit() or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"expected a TCP port, 1 to 65535 (0 = off), got "
                                         f"{text!r}")
    return int(text)


def _flag_or_env(parser: argparse.ArgumentParser, flag: int | None, env: str,
                 convert: Callable[[str], int]) -> int | None:
    """The flag where given, else the environment variable's value (flags > env); a bad value
    is a usage error naming the variable."""
    if flag is not None or not os.environ.get(env):
        return flag
    try:
        return convert(os.environ[env])
    except argparse.ArgumentTypeError as err:
        parser.error(f"{env}: {err}")


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
    parser.add_argument("--share", type=_share, default=WHOLE, metavar="F",
                        help="guaranteed share of GPU time, in (0, 1] (default 1)")
    parser.add_argument("--limit", type=_share, default=None, metavar="F",
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
    parser.add_argument("--metrics-port", type=_port, default=None, metavar="PORT",
                        help=f"your daemon serves Prometheus /metrics on 127.0.0.1:PORT when "
                             f"this command starts it (env {ENV_METRICS_PORT}; default 0, "
                             "off); pick a port of your own: each user has a daemon")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND...")
    args = parser.parse_args(argv)
    command = list(args.command)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        parser.error("no COMMAND given: gemini-run [options] -- COMMAND...")
    simulate = _flag_or_env(parser, args.simulate_gpus, ENV_SIMULATE, _count)
    if args.limit is not None and args.limit < args.share:
        parser.error(f"--limit {args.limit:g} is below --share {args.share:g}: the cap on a "
                     "share cannot be less than the share guaranteed")
    metrics_port = _flag_or_env(parser, args.metrics_port, ENV_METRICS_PORT, _port)
    named = args.state_dir or os.environ.get(ENV_STATE_DIR)
    return Request(
        gpu=args.gpu, share=args.share, limit=args.limit, memory=args.memory,
        state_dir=Path(named or paths.default_state_dir()), overcommit=args.overcommit,
        simulate_gpus=simulate, hook_library=args.hook_library or os.environ.get(
            ENV_HOOK_LIBRARY), command=command, state_dir_named=bool(named),
        metrics_port=metrics_port or 0)


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


def shares_in_use(state_dir: Path, uuid: str) -> list[tuple[AllocationRecord, Share]]:
    used = []
    for _path, record in allocation.scan_records(state_dir):
        if isinstance(record, AllocationRecord):
            used += [(record, g.share) for g in record.gpus if g.uuid == uuid]
    return used


def held_by_others(gpus: list[GpuInfo]) -> dict[str, gpulock.Holder]:
    """The GPUs another user's daemon (or the host daemon) serves now, host-wide (gpulock.py):
    this user's daemon would refuse them. An untrustworthy lock directory is refused here."""
    held = {}
    for gpu in gpus:
        try:
            holder = gpulock.holder(gpulock.lock_dir(), gpu.uuid, os.geteuid())
        except gpulock.GpuLockError as err:
            raise RunError(str(err)) from None
        if holder is not None:
            held[gpu.uuid] = holder
    return held


def choose_gpu(gpus: list[GpuInfo], wanted: str | None, state_dir: Path, share: Share,
               held: dict[str, gpulock.Holder] | None = None) -> GpuInfo:
    """The GPU asked for, else the first with room that no other user's daemon holds."""
    held = held or {}
    if wanted is not None:
        for gpu in gpus:
            if wanted in (str(gpu.index), gpu.uuid):
                if gpu.uuid in held:
                    raise RunError(gpulock.refusal(held[gpu.uuid], os.geteuid()))
                return gpu
        known = ", ".join(f"{g.index} ({g.uuid})" for g in gpus)
        raise RunError(f"no GPU {wanted!r} on this machine; known: {known}")
    free = [gpu for gpu in gpus if gpu.uuid not in held]
    if len(gpus) == 1 and not free:
        raise RunError(gpulock.refusal(held[gpus[0].uuid], os.geteuid()))
    if not free:
        holders = "; ".join(f"GPU {g.index}: {held[g.uuid].describe()}" for g in gpus)
        raise RunError(f"every GPU of this machine is held by another daemon ({holders}): "
                       f"{gpulock.advice(held[gpus[0].uuid], os.geteuid())}")
    for gpu in free:
        if total(s for _, s in shares_in_use(state_dir, gpu.uuid)) + share.value <= 1:
            return gpu
    return free[0]  # none has room: the admission check explains


def admit(state_dir: Path, gpu: GpuInfo, share: Share, overcommit: bool) -> None:
    in_use = shares_in_use(state_dir, gpu.uuid)
    used = total(s for _, s in in_use)
    if used + share.value <= 1 or overcommit:
        return
    holders = "; ".join(f"{r.id} ({r.origin}" + (f", pid {r.owner_pid}" if r.owner_pid else "")
                        + _pod_note(state_dir, r) + f"): {s:g}" for r, s in in_use)
    raise RunError(
        f"GPU {gpu.index} ({gpu.uuid}) has {max(0.0, float(1 - used)):g} of its time free and "
        f"--share {share:g} was asked; in use: {holders}. Ask for a smaller --share, another "
        "--gpu, or pass --overcommit.")


# ---- stale records ----

def _pod_note(state_dir: Path, record: AllocationRecord) -> str:
    binding = allocation.load_binding(state_dir, record.id) or record.carried
    return f", pod {binding.pod.namespace}/{binding.pod.name}" if binding else ""


def owner_alive(record: AllocationRecord) -> bool:
    pid = record.owner_pid
    if not pid:
        return True  # nothing to judge by: keep it
    return procs.alive_since(pid, record.created_at)


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


def ensure_daemon(state_dir: Path, simulate_gpus: int | None, metrics_port: int = 0
                  ) -> subprocess.Popen[bytes] | None:
    """Start gemini-daemon detached (new session) unless one holds the lock already."""
    if daemon_lock.is_held(state_dir):
        return None
    package_root = str(Path(vgpu_runtime.__file__).resolve().parents[1])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    log_fd = securedir.open_nofollow(state_dir / DAEMON_LOG_NAME,
                                     os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    # The daemon sees the GPUs gemini-run sees (gemini-vgpu status lists them), and claims
    # each it serves host-wide, in the lock directory gemini-run checked.
    simulate = ["--simulate-gpus", str(simulate_gpus)] if simulate_gpus else []
    simulate += ["--gpu-lock-dir", str(gpulock.lock_dir())]
    with open(log_fd, "ab") as log, open(os.devnull, "rb") as devnull:
        # A second daemon started by a racing gemini-run exits at once on the lock: harmless.
        return subprocess.Popen(
            # Metrics only where asked (the module's docstring says why).
            [sys.executable, "-m", "vgpu_runtime.daemon", "--state-dir", str(state_dir),
             "--metrics-port", str(metrics_port), "--metrics-address", METRICS_ADDRESS,
             "--idle-exit", f"{DAEMON_IDLE_EXIT:g}", *simulate],
            stdin=devnull, stdout=log, stderr=log, cwd="/", env=env, start_new_session=True,
            preexec_fn=_unblock_signals)


def wait_for_channel(record: AllocationRecord, daemon: subprocess.Popen[bytes] | None,
                     request: Request) -> None:
    state_dir = request.state_dir
    socket_path = paths.channel_socket(record.channel_dir)
    deadline = time.monotonic() + DAEMON_START_TIMEOUT
    next_ask = time.monotonic() + REFUSAL_POLL
    while not socket_path.exists():
        pending = signal.sigtimedwait(FORWARDED, 0)
        if pending is not None:
            raise Interrupted(pending.si_signo)
        if time.monotonic() >= next_ask:
            next_ask = time.monotonic() + REFUSAL_POLL
            refused = daemon_refusal(state_dir, record)
            if refused is not None:
                raise RunError(f"gemini-daemon will not serve the allocation: {refused}")
        if daemon is None and not daemon_lock.is_held(state_dir):
            # The running daemon exited (idle_exit) before it saw the record: start one.
            daemon = ensure_daemon(state_dir, request.simulate_gpus, request.metrics_port)
        if daemon is not None and daemon.poll() is not None and not daemon_lock.is_held(
                state_dir):
            raise RunError(f"gemini-daemon exited with status {daemon.returncode}; see "
                           f"{state_dir / DAEMON_LOG_NAME}")
        if time.monotonic() > deadline:
            raise RunError(f"no channel socket {socket_path} after {DAEMON_START_TIMEOUT:g}s: is "
                           f"gemini-daemon serving {state_dir}? See "
                           f"{state_dir / DAEMON_LOG_NAME}")
        time.sleep(0.02)


def daemon_refusal(state_dir: Path, record: AllocationRecord) -> str | None:
    """Why the running daemon will not serve `record` (a GPU another user's daemon took first,
    say), from its status; None while it has not refused it."""
    try:
        status = client.request(state_dir, "status", timeout=2.0)
    except (OSError, ValueError):
        return None
    for bad in status.get("corrupt_records", []) if isinstance(status, dict) else []:
        if Path(str(bad.get("path"))).name == f"{record.id}.json":
            return str(bad.get("error"))
    return None


def metrics_note(state_dir: Path, asked: int) -> str | None:
    """What the user should know of the metrics port they asked for, from the running daemon's
    status; None when it serves that port (or cannot be asked: the command runs regardless)."""
    try:
        status = client.request(state_dir, "status", timeout=2.0)
        daemon = status["daemon"]
        served = daemon.get("metrics")
    except (OSError, ValueError, KeyError, TypeError):
        return None
    stop = f"gemini-vgpu stop --state-dir {state_dir}"
    if served is None:
        return (f"your daemon (pid {daemon.get('pid')}) was started without metrics and keeps "
                f"running so; for /metrics on port {asked}, run {stop} once none of your "
                "commands runs, then run again")
    if served.get("asked") != asked:
        return (f"your daemon (pid {daemon.get('pid')}) serves metrics on port "
                f"{served.get('port') or served.get('asked')}, not {asked}: it keeps the port it "
                f"was started with ({stop} once none of your commands runs, to change it)")
    if served.get("port") is None:
        return (f"metrics port {asked} is unavailable ({served.get('error')}), another program "
                f"or user holds it: your daemon runs without /metrics; pick another port "
                f"({stop} once none of your commands runs, then run again)")
    return None


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


def mps_environment(state_dir: Path) -> dict[str, str]:
    """Where the daemon runs its tenants over MPS (its status says so), the client's pipe
    directory; nothing where it does not. A daemon that cannot be asked leaves the command a
    plain CUDA context, still gated by the tokens, and the user is told."""
    try:
        status = client.request(state_dir, "status", timeout=5.0)
        mps = status["daemon"].get("mps")
    except (OSError, ValueError, KeyError, TypeError) as err:
        print(f"{PROG}: warning: could not ask the daemon whether it runs MPS ({err}); the "
              "command runs without it", file=sys.stderr, flush=True)
        return {}
    return {} if not mps else {"CUDA_MPS_PIPE_DIRECTORY": str(mps["pipe_dir"])}


def child_environment(record: AllocationRecord, library: Path) -> dict[str, str]:
    env = dict(os.environ)
    preload = env.get("LD_PRELOAD")
    env["LD_PRELOAD"] = f"{library}:{preload}" if preload else str(library)
    env.update(containerenv.container_environment(record, record.channel_dir))
    return env


def become_subreaper() -> None:
    """COMMAND's orphans (a double fork, a daemonised worker) are re-parented here, not to
    init: the node daemon attributes a process that never connects to this allocation by its
    parents leading to owner_pid (attribution.py), for as long as this runs."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def reap_orphans(child: int) -> None:
    """Reap the exited orphans re-parented here; COMMAND itself (`child`) is Popen's to reap."""
    while True:
        try:
            info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return
        if info is None or info.si_pid == child:
            return
        with contextlib.suppress(ChildProcessError):
            os.waitpid(info.si_pid, 0)


def supervise(command: list[str], env: dict[str, str]) -> int:
    """Run COMMAND, forwarding signals (they are blocked here and read with sigwaitinfo)."""
    become_subreaper()
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
            reap_orphans(child.pid)
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


def run_on_host(request: Request, host: Path, library: Path) -> int:
    """Through the host daemon: it admits across users and makes the allocation; this process's
    connection is its lease, so it ends with this process however this process ends."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)   # as in run(), below
    signal.pthread_sigmask(signal.SIG_BLOCK, WATCHED)
    try:
        try:
            lease = host_client.Lease(host, gpu=request.gpu, share=request.share.to_json(),
                                      limit=optional_json(request.limit), memory=request.memory,
                                      overcommit=request.overcommit,
                                      hook_library=library.name)
        except host_client.HostRefused as err:
            raise RunError(f"the host daemon refused: {err}") from None
        except host_client.HostError as err:
            raise RunError(str(err)) from None
        try:
            return supervise(request.command, child_environment(lease.record, library))
        finally:
            lease.end()
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, WATCHED)


def run(request: Request) -> int:
    check_command(request.command)
    library = hook_library_path(request)
    # The machine's host daemon serves every user where an administrator installed it.
    host = hoststate.find_host(request.state_dir if request.state_dir_named else None)
    if host is not None:
        if request.metrics_port:
            marker = hoststate.read_marker(host)
            port = f" on port {marker.metrics_port}" if marker and marker.metrics_port else ""
            print(f"{PROG}: note: --metrics-port is for a daemon of your own; the host daemon "
                  f"serves this machine and its metrics{port} are the administrator's",
                  file=sys.stderr, flush=True)
        return run_on_host(request, host, library)
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
            gpu = choose_gpu(gpus, request.gpu, request.state_dir, request.share,
                             held_by_others(gpus))
            admit(request.state_dir, gpu, request.share, request.overcommit)
            record = build_record(request, gpu, library)
            Path(record.channel_dir).mkdir(mode=0o700)
            allocation.write_record(request.state_dir, record)
        daemon = ensure_daemon(request.state_dir, request.simulate_gpus, request.metrics_port)
        wait_for_channel(record, daemon, request)
        note = metrics_note(request.state_dir, request.metrics_port) \
            if request.metrics_port else None
        if note is not None:
            print(f"{PROG}: note: {note}", file=sys.stderr, flush=True)
        env = child_environment(record, library) | mps_environment(request.state_dir)
        return supervise(request.command, env)
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
