"""gemini-host: the host daemon, one per machine, serving every user of a Unix group.

    gemini-host install [--host-group gemini] [--no-start] ...   (root)
    gemini-host uninstall [--remove-group]                       (root)
    gemini-host unit ...           print the systemd unit that install writes
    gemini-host serve [settings]   run the daemon (what the unit runs; daemon/host/main.py)

install makes the group if it is missing, marks the state directory as the host daemon's (so the
node DaemonSet refuses it, and gemini-run and gemini-vgpu find the daemon), writes the systemd
unit and, where systemd runs, enables and starts it. It refuses to write a unit that would run,
as root, code that another user can change (this Python, this package, their directories). The
unit runs `serve` with the settings given to install. uninstall stops and removes the unit, the
mark, the socket and the host's allocations, and says what it leaves and why: the group (its
members may use it for more), the state directory's other files, the GPU lock files in
/run/lock (a tmpfs, gone at the next boot).
"""

from __future__ import annotations

import argparse
import contextlib
import grp
import os
import shlex
import shutil
import stat
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import vgpu_runtime
from vgpu_runtime import hoststate
from vgpu_runtime.common import cli, securedir
from vgpu_runtime.contracts import allocation, paths
from vgpu_runtime.daemon import lock as daemon_lock

PROG = "gemini-host"
UNIT_NAME = f"{hoststate.HOST_UNIT}.service"
DEFAULT_UNIT_DIR = "/etc/systemd/system"
SOURCE_ROOT = Path(vgpu_runtime.__file__).resolve().parents[1]


class HostCtlError(Exception):
    """What stops install or uninstall; the message says what to do."""


def systemd_runs() -> bool:
    return Path("/run/systemd/system").is_dir()   # sd_booted()'s test


def serve_command(python: str, state_dir: str, group: str, metrics_port: int,
                  extra: Sequence[str] = ()) -> list[str]:
    return [python, "-m", "vgpu_runtime.daemon.host", "--state-dir", state_dir,
            "--host-group", group, "--metrics-port", str(metrics_port), *extra]


def unit_text(command: Sequence[str], state_dir: str, lock_dir: str) -> str:
    """The systemd unit: root, restarted on failure, writing only its state directory and the
    GPU locks (a missing lock directory is the daemon's to refuse, with its message)."""
    return f"""\
[Unit]
Description=gemini.ai/vgpu host daemon: GPU sharing for every user of this machine
After=local-fs.target

[Service]
Type=simple
ExecStart={shlex.join(command)}
Environment=PYTHONPATH={SOURCE_ROOT}
Restart=on-failure
RestartSec=5
LimitNOFILE=1048576
NoNewPrivileges=yes
ProtectSystem=strict
ReadWritePaths={state_dir} -{lock_dir}
ProtectHome=read-only
PrivateTmp=yes
ProtectKernelTunables=yes
ProtectKernelModules=yes
ProtectControlGroups=yes
RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6

[Install]
WantedBy=multi-user.target
"""


# ---- the code the unit would run as root ----

def _chain(path: Path) -> Iterator[Path]:
    """`path` and every directory above it."""
    yield path
    yield from path.parents


def _untrusted(path: Path) -> str | None:
    """Why another user could change `path` (not root's, or writable by others), or None."""
    try:
        st = os.lstat(path)
    except OSError as err:
        return f"{path}: {err.strerror}"
    if st.st_uid != 0:
        return f"{path} is owned by uid {st.st_uid}"
    sticky_dir = stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX
    if st.st_mode & 0o022 and not stat.S_ISLNK(st.st_mode) and not sticky_dir:
        return f"{path} has mode {stat.S_IMODE(st.st_mode):04o}: others may write in it"
    return None


def untrusted_code(python: str) -> list[str]:
    """What another user could change of the code the unit would run as root: its Python (and
    this one) and their directories, the package's files and directories, every import path's
    directories."""
    problems: list[str] = []
    seen: set[Path] = set()

    def check(path: Path) -> None:
        for part in _chain(path):
            if part not in seen:
                seen.add(part)
                problem = _untrusted(part)
                if problem:
                    problems.append(problem)

    for executable in (python, sys.executable):
        check(Path(os.path.abspath(executable)))
        check(Path(os.path.realpath(executable)))
    for entry in sys.path:
        if entry and os.path.isdir(entry):
            check(Path(entry).resolve())
    for package in ("vgpu_runtime", "device_plugin"):
        for root, dirs, files in os.walk(SOURCE_ROOT / package):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            for name in [*dirs, *files]:
                check(Path(root) / name)
    return problems


# ---- install, uninstall ----

def _run(argv: list[str]) -> None:
    result = subprocess.run(argv, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise HostCtlError(f"{shlex.join(argv)} failed: {result.stderr.strip()}")


def ensure_group(name: str) -> str:
    with contextlib.suppress(KeyError):
        members = grp.getgrnam(name).gr_mem
        return f"group {name} exists (members: {', '.join(members) or 'none yet'})"
    _run(["groupadd", "--system", name])
    return f"group {name} created"


def install(args: argparse.Namespace) -> list[str]:
    if os.geteuid() != 0:
        raise HostCtlError("install as root: sudo gemini-host install")
    problems = untrusted_code(args.python)
    if problems:
        raise HostCtlError(
            "the unit would run, as root, code that another user can change: "
            + "; ".join(problems[:5]) + ("; ..." if len(problems) > 5 else "")
            + ". Install the package where only root writes (sudo python3 -m venv "
            "/opt/gemini-vgpu; sudo /opt/gemini-vgpu/bin/pip install <this checkout>), then run "
            "/opt/gemini-vgpu/bin/gemini-host install")
    state = Path(args.state_dir)
    done = [ensure_group(args.host_group)]
    state.mkdir(parents=True, exist_ok=True, mode=0o755)
    try:
        securedir.check_owned_dir(state, 0)
        hoststate.refuse_node_state(state)
    except (securedir.InsecureDirectory, hoststate.MachineTaken) as err:
        raise HostCtlError(str(err)) from None
    hoststate.write_marker(state, args.host_group, args.metrics_port)
    done.append(f"state directory {state} marked as the host daemon's "
                f"({paths.host_marker(state)}): the node DaemonSet refuses it from now on")
    extra = ["--simulate-gpus", str(args.simulate_gpus)] if args.simulate_gpus else []
    command = serve_command(args.python, str(state), args.host_group, args.metrics_port, extra)
    unit = Path(args.unit_dir) / UNIT_NAME
    unit.parent.mkdir(parents=True, exist_ok=True)
    unit.write_text(unit_text(command, str(state), args.gpu_lock_dir))
    os.chmod(unit, 0o644)
    done.append(f"unit {unit} written")
    if args.no_start:
        done.append(f"not started (--no-start): sudo systemctl enable --now {UNIT_NAME}")
    elif systemd_runs():
        _run(["systemctl", "daemon-reload"])
        _run(["systemctl", "enable", "--now", UNIT_NAME])
        done.append(f"enabled and started: systemctl status {UNIT_NAME}")
    else:
        done.append(f"systemd does not run here: start the daemon by hand: {shlex.join(command)}")
    done.append(f"users it serves: the members of group {args.host_group} (sudo usermod -aG "
                f"{args.host_group} <user>; they log in again). Metrics: "
                f"http://127.0.0.1:{args.metrics_port}/metrics")
    return done


def uninstall(args: argparse.Namespace) -> list[str]:
    if os.geteuid() != 0:
        raise HostCtlError("uninstall as root: sudo gemini-host uninstall")
    state = Path(args.state_dir)
    unit = Path(args.unit_dir) / UNIT_NAME
    done = []
    if systemd_runs() and unit.exists():
        _run(["systemctl", "disable", "--now", UNIT_NAME])
        done.append(f"stopped and disabled {UNIT_NAME}")
    if daemon_lock.is_held(state):
        raise HostCtlError(f"a daemon still serves {state} (pid "
                           f"{daemon_lock.holder_pid(state) or 'unknown'}): stop it first")
    if unit.exists():
        unit.unlink()
        if systemd_runs():
            _run(["systemctl", "daemon-reload"])
        done.append(f"removed {unit}")
    ended = []
    for path, record in allocation.scan_records(state):
        if isinstance(record, allocation.AllocationRecord) and record.owner_uid is not None:
            allocation.end_allocation(state, record.id, record)   # record, then its directory
            ended.append(path.stem)
    if ended:
        done.append(f"removed {len(ended)} allocation(s) of users ({', '.join(ended[:5])}); "
                    "their commands, if still running, go on self-gated at their shares")
    for path in (paths.host_socket(state),):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            done.append(f"removed {path}")
    channels = paths.host_channels_dir(state)
    if channels.is_dir():
        shutil.rmtree(channels)
        done.append(f"removed {channels}")
    if hoststate.remove_marker(state):
        done.append(f"removed the mark {paths.host_marker(state)}: the machine may now run "
                    "the node DaemonSet, and gemini-run a daemon per user")
    members: list[str] = []
    with contextlib.suppress(KeyError):
        members = grp.getgrnam(args.host_group).gr_mem
        if args.remove_group:
            _run(["groupdel", args.host_group])
            done.append(f"removed group {args.host_group}")
        else:
            done.append(f"left group {args.host_group} (members: {', '.join(members) or 'none'})"
                        f": it may serve more than this; sudo groupdel {args.host_group} "
                        "removes it")
    done.append(f"left {state} and its other files (interposer libraries, root's own "
                f"allocations), and the GPU lock files in {args.gpu_lock_dir} (a tmpfs: gone "
                "at the next boot; each user's daemon locks there again)")
    return done


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--state-dir", default=paths.DEFAULT_STATE_DIR, metavar="DIR",
                        help=f"the daemon's state directory (default {paths.DEFAULT_STATE_DIR})")
    parser.add_argument("--host-group", default=paths.DEFAULT_HOST_GROUP, metavar="GROUP",
                        help="the group whose members it serves (default "
                             f"{paths.DEFAULT_HOST_GROUP})")
    parser.add_argument("--unit-dir", default=DEFAULT_UNIT_DIR, metavar="DIR",
                        help=f"where the unit goes (default {DEFAULT_UNIT_DIR})")
    parser.add_argument("--gpu-lock-dir", default=paths.DEFAULT_GPU_LOCK_DIR, metavar="DIR",
                        help="the host-wide GPU locks' directory (default "
                             f"{paths.DEFAULT_GPU_LOCK_DIR})")


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(
        prog=PROG, description="The host daemon: one gemini.ai/vgpu daemon for every user of "
        "a machine without Kubernetes. Subcommands: install, uninstall, unit, serve.")
    cli.add_version(top)
    commands = top.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, text in (("install", "create the group, mark the state directory, write and "
                        "start the systemd unit (root)"),
                       ("unit", "print the systemd unit install writes")):
        sub = commands.add_parser(name, help=text, description=text)
        _common(sub)
        sub.add_argument("--metrics-port", type=int, default=paths.HOST_METRICS_PORT,
                         metavar="PORT", help="its metrics port (default "
                         f"{paths.HOST_METRICS_PORT}; the node daemon's is 9401)")
        sub.add_argument("--simulate-gpus", type=int, default=0, metavar="N",
                         help="simulated GPUs instead of NVML (machines without a GPU)")
        sub.add_argument("--python", default=sys.executable, metavar="PATH",
                         help="the Python the unit runs (default: this one)")
        if name == "install":
            sub.add_argument("--no-start", action="store_true",
                             help="write the unit, do not enable or start it")
    sub = commands.add_parser("uninstall", help="stop and remove the unit, the mark, the socket "
                              "and users' allocations; say what is left (root)")
    _common(sub)
    sub.add_argument("--remove-group", action="store_true", help="remove the group too")
    commands.add_parser("serve", help="run the host daemon (what the unit runs; its settings: "
                        "gemini-host serve --help)", add_help=False)
    return top


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:
        from vgpu_runtime.daemon.host.main import main as serve

        return serve(argv[1:])
    args = parser().parse_args(argv)
    try:
        if args.command == "unit":
            command = serve_command(args.python, args.state_dir, args.host_group,
                                    args.metrics_port, ["--simulate-gpus", str(args.simulate_gpus)]
                                    if args.simulate_gpus else [])
            print(unit_text(command, args.state_dir, args.gpu_lock_dir), end="")
            return 0
        done = install(args) if args.command == "install" else uninstall(args)
    except HostCtlError as err:
        cli.error(PROG, str(err))
        return 1
    except OSError as err:
        cli.error(PROG, f"{args.command}: {err}")
        return 1
    for line in done:
        print(f"{PROG}: {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
