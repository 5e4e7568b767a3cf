"""gemini-vgpu: the operator's view of a node. `gemini-vgpu status` asks the node daemon;
`gemini-vgpu stop` stops it (the one gemini-run started in the background, typically).

The daemon's control socket (<state-dir>/scheduler.sock) is private to the daemon's user: on a
node that is root, with gemini-run it is the user who ran it (a per-user state directory). Where
the host daemon is installed (hoststate.py), both ask it instead, through its group's socket:
each user sees their own allocations and what is free; it is stopped through its unit.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vgpu_runtime import hoststate
from vgpu_runtime.common import cli
from vgpu_runtime.common.sizes import format_size
from vgpu_runtime.contracts import paths
from vgpu_runtime.daemon import lock as daemon_lock
from vgpu_runtime.daemon.channel import client
from vgpu_runtime.daemon.control import control_socket
from vgpu_runtime.daemon.host import client as host_client

PROG = "gemini-vgpu"
STOP_TIMEOUT = 15.0   # the daemon closes every channel first; 15 s is what gemini-run allows
FREE_COLUMNS = ("INDEX", "GPU", "MODEL", "MEMORY", "FREE SHARE", "FREE SLICES", "HEALTH")
HOST_FREE_COLUMNS = ("INDEX", "GPU", "MODEL", "MEMORY", "FREE SHARE", "FREE MEMORY", "HEALTH")
COLUMNS = ("CONTAINER", "ALLOCATION", "REQUEST", "LIMIT", "ACHIEVED", "MEMORY USED / LIMIT",
           "WAIT P50", "WAIT P99", "REVOKED", "HOLDER")


class StatusError(RuntimeError):
    """The daemon could not be asked; the message says why and what to do."""


def fetch_status(state_dir: str) -> dict[str, Any]:
    return ask(state_dir, "status")


def ask(state_dir: str, op: str, **fields: Any) -> dict[str, Any]:
    socket_path = control_socket(state_dir)
    try:
        answer = client.request(state_dir, op, **fields)
    except FileNotFoundError:
        if op == "stop":
            raise StatusError(f"no gemini-daemon runs for {state_dir}: nothing to stop") \
                from None
        raise StatusError(f"no gemini-daemon serves {state_dir}: {socket_path} does not "
                          "exist. Start the daemon (gemini-daemon --state-dir "
                          f"{state_dir}), or pass the --state-dir it uses.") from None
    except PermissionError:
        raise StatusError(f"permission denied on {socket_path}: the control socket is private "
                          "to the daemon's user (root on a node); run as that user.") from None
    except ConnectionRefusedError:
        if op == "stop":
            raise StatusError(f"no gemini-daemon runs for {state_dir} (a stale socket): "
                              "nothing to stop") from None
        raise StatusError(f"no gemini-daemon answers on {socket_path} (a stale socket: the "
                          "daemon is not running). Start it again.") from None
    except OSError as err:
        raise StatusError(f"cannot ask gemini-daemon on {socket_path}: {err}") from None
    except ValueError as err:
        raise StatusError(f"gemini-daemon on {socket_path} gave no valid answer: {err}") \
            from None
    if not isinstance(answer, dict):
        raise StatusError(f"gemini-daemon gave no valid answer to {op}: {answer!r}")
    if "error" in answer:
        raise StatusError(f"gemini-daemon refused {op}: {answer['error']}")
    return answer


def stop_daemon(state_dir: str, force: bool, timeout: float) -> int:
    """Ask the daemon to stop, then wait until its lock is free; returns its pid."""
    answer = ask(state_dir, "stop", force=force)
    deadline = time.monotonic() + timeout
    while daemon_lock.is_held(state_dir):
        if time.monotonic() > deadline:
            raise StatusError(f"gemini-daemon pid {answer.get('pid')} was asked to stop but "
                              f"still holds {state_dir} after {timeout:g} s")
        time.sleep(0.05)
    return int(answer.get("pid", 0))


def _container(entry: dict[str, Any] | None) -> str:
    if entry is None:
        return "?"
    pod = entry.get("pod")
    if pod:
        return f"{pod['namespace']}/{pod['name']}/{pod['container']}"
    if entry.get("owner_uid") is not None:   # the host daemon's: whose, and which process
        return f"uid {entry['owner_uid']} pid {entry.get('owner_pid') or '?'}"
    if entry.get("owner_pid"):
        return f"{entry['origin']} pid {entry['owner_pid']}"
    return str(entry.get("origin", "?"))


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} ms"


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
            for row in rows]


def _free(gpus: list[dict[str, Any]], host: bool = False) -> list[str]:
    """What is left on each GPU: time (a gemini-run --share) and slices (a pod's request); on
    a host daemon's machine, memory instead of slices (no pods there)."""
    if not gpus:
        return ["no GPU found by the daemon (NVML found none; a daemon started with "
                "--simulate-gpus N shows simulated ones)"]
    rows: list[tuple[str, ...]] = [HOST_FREE_COLUMNS if host else FREE_COLUMNS]
    for gpu in gpus:
        total = gpu.get("memory_total")
        health = "healthy" if gpu.get("healthy", True) else f"unhealthy: {gpu.get('reason', '')}"
        if host:
            left = "?" if total is None else format_size(
                max(0, total - gpu.get("memory_allocated", 0)))
        else:
            left = f"{max(0, gpu['slices'] - gpu['slices_allocated'])} of {gpu['slices']}"
        rows.append((
            str(gpu.get("index", "?")), gpu["uuid"], gpu.get("model") or "?",
            "?" if total is None else format_size(total),
            f"{max(0.0, 1 - gpu.get('share_allocated', 0.0)):.2f}", left, health))
    return _table(rows)


def _mps_line(mps: dict[str, Any]) -> str:
    """Over MPS: where its pipes are, and whose control daemon it is."""
    where = f"commands run over MPS: the control daemon's pipes in {mps['pipe_dir']}"
    if mps.get("managed", True):
        return where
    if mps.get("adopted"):
        return f"{where} (its own container runs it: gemini-mps-control)"
    return (f"{where}, but none answers yet (its own container runs it: gemini-mps-control); "
            "pods are refused until it has started")


def _metrics_line(metrics: dict[str, Any] | None, on_demand: bool, host: bool = False) -> str:
    if metrics is None:
        if host:
            return (f"metrics: off (the host daemon's --metrics-port, in its unit "
                    f"{hoststate.HOST_UNIT})")
        return "metrics: off" + (" (gemini-run --metrics-port PORT starts your daemon with "
                                 "them)" if on_demand else "")
    if metrics.get("port") is None:
        return (f"metrics: port {metrics.get('asked')} unavailable ({metrics.get('error')}); "
                "none served")
    url = f"metrics: http://{metrics.get('address')}:{metrics['port']}/metrics"
    # The host daemon's port shows every user's allocations (README, "without Kubernetes").
    return url + (" (the host daemon's, for the operator: every user's allocations)"
                  if host else "")


def render(status: dict[str, Any]) -> str:
    daemon = status["daemon"]
    settings = daemon.get("token_settings", {})
    viewer = status.get("viewer") or {}
    host = bool(viewer.get("host"))
    lines = [f"{'host daemon' if host else 'gemini-daemon'} pid {daemon['pid']} (version "
             f"{daemon['version']}), state {daemon['state_dir']}, limit policy "
             f"{daemon.get('limit_policy', '?')}, share window {settings.get('window', '?')} s"]
    if host and not viewer.get("everyone"):
        lines.append(f"it serves every user of this machine; shown to uid {viewer['uid']}: "
                     "your allocations, and what is free")
    if daemon.get("idle_exit"):   # started on demand (gemini-run)
        lines.append(f"exits after {daemon['idle_exit']:g} s without allocations; stop it now "
                     f"with: gemini-vgpu stop --state-dir {daemon['state_dir']}")
    if "metrics" in daemon:
        lines.append(_metrics_line(daemon["metrics"], bool(daemon.get("idle_exit")), host))
    if daemon.get("mps"):
        lines.append(_mps_line(daemon["mps"]))
    lines.append("")
    lines.append("GPUs and what is free (FREE SHARE for gemini-run --share, " + (
        "FREE MEMORY for its --memory):" if host else
        "FREE SLICES for pods' gemini.ai/vgpu requests):"))
    lines.extend(_free(status.get("node", {}).get("gpus", []), host))
    allocations = {a["id"]: a for a in status.get("allocations", [])}
    gpus = status.get("gpus", [])
    if not gpus:
        lines.append("")
        lines.append("no allocations: no GPU is shared yet")
    for gpu in gpus:
        holder = gpu["holder"] or "nobody"
        if gpu["holder"] and gpu.get("holder_remaining_ms") is not None:
            holder += f" ({gpu['holder_remaining_ms']:.1f} ms left)"
        gate = "open (one container owns it whole)" if gpu["gate"] == "open" else "token"
        lines.append("")
        lines.append(f"GPU {gpu['uuid']}  gate: {gate}  holder now: {holder}")
        others = gpu.get("others") or {}
        if others.get("allocations"):   # the host daemon's: other users', counted, not shown
            lines.append(f"  other users: {others['allocations']} allocation(s), request "
                         f"{others['request']:.2f}, memory limits "
                         f"{format_size(others['memory_limit'])}")
        if not gpu["tenants"]:   # its last allocation ended
            lines.append("  none of yours now" if others else "  no containers now")
            continue
        rows: list[tuple[str, ...]] = [COLUMNS]
        for t in gpu["tenants"]:
            rows.append((
                _container(allocations.get(t["allocation"])), t["allocation"],
                f"{t['request']:.2f}", f"{t['limit']:.2f}", f"{t['achieved']:.2f}",
                f"{format_size(t['memory_used'])} / {format_size(t['memory_limit'])}",
                _ms(t["wait_p50_ms"]), _ms(t["wait_p99_ms"]), str(t["revocations"]),
                "*" if t["holder"] else ("waiting" if t["waiting"] else "")))
        lines.extend(_table(rows))
    for bad in status.get("corrupt_records", []):
        lines.append(f"corrupt record {bad['path']}: {bad['error']}")
    return "\n".join(lines)


def host_command(command: str, host: Path, as_json: bool) -> int:
    """status and stop on a machine whose host daemon serves every user."""
    if command == "stop":
        raise StatusError(f"the host daemon serves every user of this machine ({host}); it is "
                          f"stopped through its unit: sudo systemctl stop {hoststate.HOST_UNIT}")
    try:
        answer = host_client.request(host, "status")
    except host_client.HostError as err:
        raise StatusError(str(err)) from None
    print(json.dumps(answer, indent=1) if as_json else render(answer))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description="gemini.ai/vgpu tools")
    cli.add_version(parser)
    commands = parser.add_subparsers(dest="command", required=True)
    status = commands.add_parser("status", help="per GPU and container: shares, memory, "
                                 "token waits and the holder now, from the node daemon")
    status.add_argument("--state-dir", metavar="DIR",
                        help=f"the daemon's state directory (env {paths.ENV_STATE_DIR}; default "
                             f"{paths.default_state_dir()})")
    status.add_argument("--json", action="store_true", help="the daemon's answer as JSON")
    stop = commands.add_parser("stop", help="stop the node daemon of the state directory (the "
                               "one gemini-run started); refused while an allocation is live")
    stop.add_argument("--state-dir", metavar="DIR",
                      help=f"the daemon's state directory (env {paths.ENV_STATE_DIR}; default "
                           f"{paths.default_state_dir()})")
    stop.add_argument("--force", action="store_true",
                      help="stop it even with live allocations (their processes then gate "
                           "themselves at their shares)")
    stop.add_argument("--timeout", type=float, default=STOP_TIMEOUT, metavar="SECONDS",
                      help=f"how long to wait for it to exit (default {STOP_TIMEOUT:g})")
    args = parser.parse_args(argv)
    named = args.state_dir or os.environ.get(paths.ENV_STATE_DIR)
    state_dir = named or paths.default_state_dir()
    host = hoststate.find_host(named)   # the machine's daemon for every user, if installed
    try:
        if host is not None:
            return host_command(args.command, host, getattr(args, "json", False))
        if args.command == "stop":
            pid = stop_daemon(state_dir, args.force, args.timeout)
            print(f"gemini-daemon pid {pid} of {state_dir} stopped")
            return 0
        answer = fetch_status(state_dir)
    except StatusError as err:
        cli.error(PROG, str(err))
        return 1
    print(json.dumps(answer, indent=1) if args.json else render(answer))
    return 0


if __name__ == "__main__":
    sys.exit(main())
