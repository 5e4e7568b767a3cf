"""gemini-run end to end: real processes, the real daemon it starts, simulated GPUs."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.childenv import as_user, child_env
from tests.daemon.helpers import make_record, wait_for
from tests.run.conftest import stop_daemon
from vgpu_runtime.contracts import allocation, paths
from vgpu_runtime.contracts.share import Share
from vgpu_runtime.daemon import lock
from vgpu_runtime.daemon.channel import client
from vgpu_runtime.gpus.simulated import DEFAULT_MEMORY, simulated_uuid

REPO = Path(__file__).resolve().parents[2]
ENV = child_env()
ENV.pop("GEMINI_SIMULATE_GPUS", None)
ENV.pop("GEMINI_STATE_DIR", None)
ENV["PYTHONFAULTHANDLER"] = "1"   # a hung gemini-run shows its stack (post_mortem)

# The command gemini-run runs: reports its environment and what the channel says, then waits
# for a line on stdin (so the test can look at the node while it runs) and exits with argv[1].
PROBE = r"""
import json, os, sys
from vgpu_runtime.daemon.channel.client import ChannelClient
channel = os.path.join(os.environ["GEMINI_CHANNEL_DIR"], "sched.sock")
c = ChannelClient(channel)
hello = c.hello()
reserve = c.reserve(0, 1 << 20)
shown = ("LD_PRELOAD", "CUDA_VISIBLE_DEVICES", "CUDA_MPS_PIPE_DIRECTORY")
print(json.dumps({"env": {k: v for k, v in os.environ.items()
                          if k.startswith("GEMINI_") or k in shown},
                  "allocation_id": hello.allocation_id, "memory_limit": hello.gpus[0].memory_limit,
                  "share_ppm": hello.gpus[0].share_ppm,
                  "reserve_granted": reserve.granted}), flush=True)
sys.stdin.readline()
sys.exit(int(sys.argv[1]))
"""


def gemini_run(state_dir: Path, library: Path, *args: str, command: list[str] | None = None,
               env: dict[str, str] | None = None, **popen: Any) -> subprocess.Popen[str]:
    argv = [sys.executable, "-m", "vgpu_runtime.run", "--state-dir", str(state_dir),
            "--simulate-gpus", "2", "--hook-library", str(library), *args, "--",
            *(command or [sys.executable, "-c", PROBE, "0"])]
    popen.setdefault("stdin", subprocess.PIPE)
    popen.setdefault("stdout", subprocess.PIPE)
    popen.setdefault("stderr", subprocess.PIPE)
    return subprocess.Popen(argv, cwd=REPO, env=env or ENV, text=True, **popen)


def probe_started(proc: subprocess.Popen[str]) -> dict[str, Any]:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        proc.wait(10)
        assert proc.stderr is not None
        raise AssertionError(f"gemini-run exited {proc.returncode}: {proc.stderr.read()}")
    result: dict[str, Any] = json.loads(line)
    return result


def finish(proc: subprocess.Popen[str]) -> tuple[int, str]:
    try:
        _out, err = proc.communicate("\n", timeout=20)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"gemini-run did not finish in 20 s\n{post_mortem(proc)}") from None
    return proc.returncode, err


def post_mortem(proc: subprocess.Popen[str]) -> str:
    """What a hung gemini-run was doing: its process tree, then its Python stack (SIGABRT with
    PYTHONFAULTHANDLER set) and whatever it wrote to stderr."""
    tree = subprocess.run(["ps", "-e", "-o", "pid,ppid,stat,wchan:24,args"], capture_output=True,
                          text=True).stdout
    related = [line for line in tree.splitlines()
               if str(proc.pid) in line.split()[:2] or line.lstrip().startswith("PID")]
    for line in related[1:]:   # pending, blocked, ignored and caught signals of each
        pid = line.split()[0]
        with contextlib.suppress(OSError):
            status = Path(f"/proc/{pid}/status").read_text().splitlines()
            related.append(f"  {pid}: " + " ".join(
                entry.replace("\t", "") for entry in status
                if entry.startswith(("SigQ", "SigPnd", "ShdPnd", "SigBlk", "SigIgn", "SigCgt"))))
    proc.send_signal(signal.SIGABRT)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(10)
    for line in related[1:]:   # its COMMAND holds the same pipes; the daemon is the fixture's
        pid, ppid, *_rest = line.split()
        if ppid == str(proc.pid) and "vgpu_runtime.daemon" not in line:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
    try:
        _out, err = proc.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        err = "(stderr still open: another process holds gemini-run's pipes)"
    return "\n".join(related) + "\n" + err


def trap(signo: int, status: int) -> list[str]:
    """A COMMAND that prints {} and exits with `status` when `signo` reaches it, up to 30 s.

    The signal is blocked before the line and taken with sigwait: a Python handler around
    time.sleep loses a signal that lands between the interpreter's last check and the sleep's
    system call (the sleep then runs its whole 30 s). That was the run tests' rare hang, about
    1 in 150 under load: gemini-run had forwarded SIGINT, the child slept on."""
    code = (f"import signal, sys; signal.pthread_sigmask(signal.SIG_BLOCK, {{{signo}}}); "
            f"print('{{}}', flush=True); "
            f"sys.exit({status} if signal.sigtimedwait({{{signo}}}, 30) else 99)")
    return [sys.executable, "-c", code]


def live_records(state_dir: Path) -> list[allocation.AllocationRecord]:
    return [r for _, r in allocation.scan_records(state_dir)
            if isinstance(r, allocation.AllocationRecord)]


def test_runs_the_command_with_its_allocation_and_cleans_up(state_dir: Path,
                                                            hook_library: Path) -> None:
    assert not lock.is_held(state_dir)
    proc = gemini_run(state_dir, hook_library, "--gpu", "1", "--share", "0.25", "--limit", "0.5",
                      command=[sys.executable, "-c", PROBE, "3"])
    seen = probe_started(proc)
    env = seen["env"]
    (record,) = live_records(state_dir)
    assert record.origin == "gemini-run" and record.owner_pid == proc.pid
    assert record.id == env["GEMINI_ALLOCATION_ID"] == seen["allocation_id"]
    assert record.hook_library == hook_library.name
    assert (record.gpus[0].uuid, record.gpus[0].share, record.limit) == (
        simulated_uuid(1), Share.of_slices(1, 4), Share.of_slices(1, 2))
    assert record.gpus[0].memory_limit == int(0.25 * DEFAULT_MEMORY) == seen["memory_limit"]
    assert env["LD_PRELOAD"] == str(hook_library)
    assert env["CUDA_VISIBLE_DEVICES"] == simulated_uuid(1)
    assert env["GEMINI_CHANNEL_DIR"] == record.channel_dir
    assert env["GEMINI_VGPU_SHARE"] == "0.25"
    assert env["GEMINI_VGPU_MEMORY_LIMIT"] == str(record.gpus[0].memory_limit)
    assert (seen["share_ppm"], seen["reserve_granted"]) == (250_000, True)
    # The daemon was started in the background, holds the lock, and shows share and limit.
    assert lock.is_held(state_dir)
    (shown,) = client.request(state_dir)["allocations"]
    assert (shown["id"], shown["limit"], shown["gpus"][0]["share"]) == (record.id, 0.5, 0.25)
    assert shown["gpus"][0]["limit_ppm"] == 500_000   # the cap the daemon enforces
    assert shown["gpus"][0]["memory_used"] == 1 << 20
    code, err = finish(proc)
    assert code == 3, err  # the command's exit status
    assert live_records(state_dir) == []
    assert not Path(record.channel_dir).exists()
    wait_for(lambda: client.request(state_dir)["allocations"] == [], 5, "daemon drops it")


def test_second_run_reuses_the_running_daemon(state_dir: Path, hook_library: Path) -> None:
    first = gemini_run(state_dir, hook_library, "--share", "0.5")
    probe_started(first)
    daemon_pid = lock.holder_pid(state_dir)
    second = gemini_run(state_dir, hook_library, "--share", "0.5")
    probe_started(second)
    assert lock.holder_pid(state_dir) == daemon_pid
    records = live_records(state_dir)
    assert len(records) == 2 and {r.gpus[0].uuid for r in records} == {simulated_uuid(0)}
    shown = client.request(state_dir)["allocations"]
    assert sorted(a["gpus"][0]["share"] for a in shown) == [0.5, 0.5]
    assert finish(first)[0] == 0 and finish(second)[0] == 0
    assert live_records(state_dir) == []


def test_overcommit_is_refused_with_what_is_in_use(state_dir: Path, hook_library: Path) -> None:
    holder = gemini_run(state_dir, hook_library, "--gpu", "0", "--share", "0.7")
    probe_started(holder)
    (held,) = live_records(state_dir)
    refused = gemini_run(state_dir, hook_library, "--gpu", "0", "--share", "0.5")
    code, err = finish(refused)
    assert code == 125
    assert "in use" in err and held.id in err and "0.7" in err and "--overcommit" in err
    assert len(live_records(state_dir)) == 1  # nothing written for the refused one
    allowed = gemini_run(state_dir, hook_library, "--gpu", "0", "--share", "0.5",
                         "--overcommit")
    probe_started(allowed)
    assert len(live_records(state_dir)) == 2
    assert finish(allowed)[0] == 0 and finish(holder)[0] == 0


def test_kubelet_records_count_and_the_default_gpu_is_one_with_room(
        state_dir: Path, hook_library: Path) -> None:
    state_dir.mkdir(parents=True)
    make_record(state_dir, gpus=((simulated_uuid(0), 1 << 30, 0.8),))
    proc = gemini_run(state_dir, hook_library, "--share", "0.5")
    seen = probe_started(proc)
    assert seen["env"]["CUDA_VISIBLE_DEVICES"] == simulated_uuid(1)
    assert finish(proc)[0] == 0
    refused = gemini_run(state_dir, hook_library, "--gpu", "0", "--share", "0.5")
    code, err = finish(refused)
    assert code == 125 and "kubelet" in err


def test_sigterm_is_forwarded_and_the_record_removed(state_dir: Path,
                                                     hook_library: Path) -> None:
    proc = gemini_run(state_dir, hook_library, command=trap(signal.SIGTERM, 7))
    probe_started(proc)
    assert len(live_records(state_dir)) == 1
    proc.send_signal(signal.SIGTERM)
    code, err = finish(proc)
    assert code == 7, err  # the child got SIGTERM and chose its status
    assert live_records(state_dir) == []


def test_an_inherited_ignored_sigchld_neither_hangs_nor_loses_the_status(
        state_dir: Path, hook_library: Path) -> None:
    # The bug: gemini-run waited forever. With SIGCHLD ignored the kernel reaps the child and
    # sends no signal, and waitpid's ECHILD read as status 0.
    proc = gemini_run(state_dir, hook_library, command=["sh", "-c", "exit 3"],
                      preexec_fn=lambda: signal.signal(signal.SIGCHLD, signal.SIG_IGN))
    code, err = finish(proc)
    assert code == 3, err
    assert live_records(state_dir) == []


def test_child_killed_by_a_signal_gives_128_plus_n(state_dir: Path, hook_library: Path) -> None:
    proc = gemini_run(state_dir, hook_library,
                      command=["sh", "-c", "kill -KILL $$"])
    code, err = finish(proc)
    assert code == 128 + signal.SIGKILL, err
    assert live_records(state_dir) == []


def test_existing_ld_preload_is_kept_after_the_hook(state_dir: Path, hook_library: Path,
                                                    tmp_path: Path) -> None:
    other = tmp_path / "libother.so"
    other.write_bytes(hook_library.read_bytes())
    proc = gemini_run(state_dir, hook_library, env={**ENV, "LD_PRELOAD": str(other)})
    seen = probe_started(proc)
    assert seen["env"]["LD_PRELOAD"] == f"{hook_library}:{other}"
    assert finish(proc)[0] == 0


def test_stale_record_of_a_dead_owner_is_cleaned_by_the_next_run(
        state_dir: Path, hook_library: Path) -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    state_dir.mkdir(parents=True)
    stale = make_record(state_dir, allocation_id=allocation.new_run_id(), origin="gemini-run",
                        owner_pid=dead.pid, gpus=((simulated_uuid(0), 1 << 30, 1.0),))
    newer = subprocess.Popen(["sleep", "30"])  # its pid, "reused" after the record was written
    reused = make_record(state_dir, allocation_id=allocation.new_run_id(), origin="gemini-run",
                         owner_pid=newer.pid, created_at=time.time() - 60,
                         gpus=((simulated_uuid(1), 1 << 30, 0.1),))
    alive = make_record(state_dir, allocation_id=allocation.new_run_id(), origin="gemini-run",
                        owner_pid=1, gpus=((simulated_uuid(1), 1 << 30, 0.1),))  # older: alive
    kubelet = make_record(state_dir, gpus=((simulated_uuid(1), 1 << 30, 0.1),))
    Path(stale.channel_dir).mkdir(parents=True)
    proc = gemini_run(state_dir, hook_library, "--gpu", "0", "--share", "1.0")
    probe_started(proc)  # admitted: the stale record's 1.0 no longer counts
    newer.kill()
    newer.wait()
    ids = {r.id for r in live_records(state_dir)}
    assert stale.id not in ids and reused.id not in ids
    assert kubelet.id in ids and alive.id in ids
    assert not Path(stale.channel_dir).exists()
    assert finish(proc)[0] == 0


def test_sigkill_of_gemini_run_leaves_a_record_the_next_run_removes(
        state_dir: Path, hook_library: Path) -> None:
    victim = gemini_run(state_dir, hook_library, "--gpu", "0", "--share", "1.0")
    probe_started(victim)
    victim.kill()
    victim.wait()
    assert len(live_records(state_dir)) == 1
    proc = gemini_run(state_dir, hook_library, "--gpu", "0", "--share", "1.0")
    probe_started(proc)
    assert [r.owner_pid for r in live_records(state_dir)] == [proc.pid]
    assert finish(proc)[0] == 0
    victim.stdin.close()  # type: ignore[union-attr]  # lets its orphaned probe exit


@pytest.mark.parametrize(("args", "message"), [
    (["--share", "1.5"], "'1.5' is outside (0, 1]; write a fraction such as 0.3 or a "
                         "percentage such as 30%"),
    (["--limit", "0"], "'0' is outside (0, 1]"),
    (["--share", "30 percent"], "is not a number; write a fraction such as 0.3"),
    (["--memory", "lots"], "expected a size"),
    (["--memory", "0"], "'0' must be more than 0"),
    (["--simulate-gpus", "0"], "positive number of GPUs"),
    (["--share", "0.5", "--limit", "0.3"], "--limit 0.3 is below --share 0.5"),
    (["--no-such-flag"], "unrecognized arguments"),
])
def test_bad_arguments_are_refused_with_a_reason(state_dir: Path, hook_library: Path,
                                                 args: list[str], message: str) -> None:
    code, err = finish(gemini_run(state_dir, hook_library, *args))
    # docker run's rule: 125 for gemini-run's own errors, usage errors included.
    assert code == 125 and "gemini-run: error: " in err and message in err
    assert not state_dir.exists()  # nothing written


def test_no_command_unknown_gpu_and_too_much_memory(state_dir: Path, hook_library: Path) -> None:
    no_command = subprocess.run(
        [sys.executable, "-m", "vgpu_runtime.run", "--simulate-gpus", "1", "--"],
        cwd=REPO, env=ENV, capture_output=True, text=True, timeout=30)
    assert no_command.returncode == 125 and "no COMMAND" in no_command.stderr
    code, err = finish(gemini_run(state_dir, hook_library, "--gpu", "7"))
    assert code == 125 and "no GPU '7'" in err and simulated_uuid(1) in err
    code, err = finish(gemini_run(state_dir, hook_library, "--memory", "1TiB"))
    assert code == 125 and "more than GPU 0 has" in err
    assert live_records(state_dir) == []


def test_command_is_checked_before_gpus_127_missing_126_not_runnable(
        state_dir: Path, hook_library: Path, tmp_path: Path) -> None:
    not_executable = tmp_path / "script.sh"
    not_executable.write_text("#!/bin/sh\nexit 0\n")
    cases = [(["no-such-command-gemini"], 127, "command not found"),
             ([str(tmp_path / "missing")], 127, "no such file"),
             ([str(not_executable)], 126, "cannot be run"),
             ([str(tmp_path)], 126, "cannot be run")]
    for command, status, message in cases:
        # No --simulate-gpus and NVML absent here: a GPU lookup would fail first with 125.
        proc = subprocess.run(
            [sys.executable, "-m", "vgpu_runtime.run", "--state-dir", str(state_dir),
             "--hook-library", str(hook_library), "--", *command],
            cwd=REPO, env=ENV, capture_output=True, text=True, timeout=30)
        assert proc.returncode == status, (command, proc.stderr)
        assert proc.stderr.startswith("gemini-run: error: ") and message in proc.stderr
        assert not state_dir.exists()   # no state directory, record or daemon


def test_the_daemon_it_starts_sees_the_simulated_gpus(state_dir: Path,
                                                      hook_library: Path) -> None:
    proc = gemini_run(state_dir, hook_library, "--share", "0.25")
    probe_started(proc)
    status = subprocess.run([sys.executable, "-m", "vgpu_runtime.cli", "status"], cwd=REPO,
                            env={**ENV, "GEMINI_STATE_DIR": str(state_dir), "COLUMNS": "400"},
                            capture_output=True, text=True, timeout=30)
    assert finish(proc)[0] == 0
    assert status.returncode == 0, status.stderr
    rows = {line.split()[1]: line.split() for line in status.stdout.splitlines()
            if line.lstrip().startswith(("0 ", "1 "))}
    assert rows[simulated_uuid(0)][-5:] == ["0.75", "8", "of", "10", "healthy"]
    assert rows[simulated_uuid(1)][-5:] == ["1.00", "10", "of", "10", "healthy"]
    # It is seen, goes by itself after 600 s without allocations, and the hint stops it now.
    assert ("exits after 600 s without allocations; stop it now with: gemini-vgpu stop "
            f"--state-dir {state_dir}") in status.stdout
    stop = subprocess.run([sys.executable, "-m", "vgpu_runtime.cli", "stop", "--state-dir",
                           str(state_dir)], cwd=REPO, env=ENV, capture_output=True, text=True,
                          timeout=30)
    assert stop.returncode == 0 and "stopped" in stop.stdout, stop.stderr
    assert not lock.is_held(state_dir)


def test_a_daemon_that_exits_while_it_waits_is_replaced(state_dir: Path,
                                                       hook_library: Path) -> None:
    # Stands in for a daemon exiting on idle_exit just before it saw the new record: it holds
    # the daemon's lock, so gemini-run starts none, and lets go a second later, serving nothing.
    state_dir.mkdir(parents=True, mode=0o700)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, os, sys, time; "
         f"fd = os.open({str(lock.lock_path(state_dir))!r}, os.O_RDWR | os.O_CREAT, 0o644); "
         "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); time.sleep(1)"],
        stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None and holder.stdout.readline() == "held\n"
    proc = gemini_run(state_dir, hook_library)
    seen = probe_started(proc)   # without a new daemon: no channel, 125 after 15 s
    assert seen["allocation_id"].startswith("r-")
    assert finish(proc)[0] == 0
    assert holder.wait(10) == 0


def test_missing_hook_library_is_a_clear_error(state_dir: Path, tmp_path: Path) -> None:
    code, err = finish(gemini_run(state_dir, tmp_path / "nope.so"))
    assert code == 125 and "nope.so does not exist" in err


def test_memory_flag_and_simulated_gpus_from_the_environment(state_dir: Path,
                                                             hook_library: Path) -> None:
    argv = [sys.executable, "-m", "vgpu_runtime.run", "--state-dir", str(state_dir),
            "--hook-library", str(hook_library), "--memory", "8GiB", "--share", "0.1", "--",
            sys.executable, "-c", PROBE, "0"]
    proc = subprocess.Popen(argv, cwd=REPO, env={**ENV, "GEMINI_SIMULATE_GPUS": "1"}, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    seen = probe_started(proc)
    assert seen["memory_limit"] == 8 << 30
    assert seen["env"]["GEMINI_VGPU_MEMORY_LIMIT"] == str(8 << 30)
    assert finish(proc)[0] == 0


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                    reason="needs root and setpriv to run as another user")
def test_non_root_user_gets_a_private_per_user_state_dir(state_dir: Path,
                                                         hook_library: Path) -> None:
    uid = 40_000 + os.getpid() % 5_000   # a real other uid (nobody else's on a test machine)
    runtime = state_dir.parent / "xdg"  # short: socket paths must fit in 107 bytes
    runtime.mkdir(mode=0o700)
    os.chown(runtime, uid, uid)
    library = state_dir.parent / hook_library.name
    shutil.copy(hook_library, library)
    argv = as_user(uid, [sys.executable, "-m", "vgpu_runtime.run", "--simulate-gpus", "1",
                         "--hook-library", str(library), "--", sys.executable, "-c", PROBE, "0"])
    proc = subprocess.Popen(argv, cwd=REPO, env={**ENV, "XDG_RUNTIME_DIR": str(runtime)},
                            text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    state_dir = runtime / "gemini"  # what paths.default_state_dir() gives a non-root user
    try:
        seen = probe_started(proc)
        assert seen["env"]["GEMINI_CHANNEL_DIR"].startswith(str(state_dir) + "/")
        for directory in (state_dir, paths.channels_dir(state_dir),
                          Path(seen["env"]["GEMINI_CHANNEL_DIR"])):
            st = directory.stat()
            assert (st.st_uid, st.st_mode & 0o777) == (uid, 0o700), directory
        assert finish(proc)[0] == 0
    finally:
        proc.kill()
        stop_daemon(state_dir)


def test_default_state_dir_depends_on_the_user(monkeypatch: pytest.MonkeyPatch,
                                               tmp_path: Path) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    assert paths.default_state_dir() == "/var/lib/gemini"
    monkeypatch.setattr(os, "geteuid", lambda: 1234)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert paths.default_state_dir() == str(tmp_path / "gemini")
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert paths.default_state_dir() == "/tmp/gemini-1234"


def test_daemon_that_cannot_start_is_reported(state_dir: Path, hook_library: Path) -> None:
    # A regular file where the control socket goes would not stop the daemon; a state dir
    # whose lock file is a directory does.
    state_dir.mkdir(parents=True)
    (state_dir / lock.LOCK_NAME).mkdir()
    start = time.monotonic()
    code, err = finish(gemini_run(state_dir, hook_library))
    assert code == 125 and "gemini-daemon exited" in err and "scheduler.log" in err
    assert time.monotonic() - start < 10
    assert live_records(state_dir) == []


def test_default_interposer_comes_from_hooklib(state_dir: Path) -> None:
    """Without --hook-library, gemini-run preloads hooklib.library_path() (built on demand)."""
    try:
        import importlib
        hooklib = importlib.import_module("vgpu_runtime.hooklib")
    except ImportError:
        # Until the hook engineer's vgpu_runtime/hooklib.py lands: a clear refusal, no record.
        argv = [sys.executable, "-m", "vgpu_runtime.run", "--state-dir", str(state_dir),
                "--simulate-gpus", "1", "--", "true"]
        result = subprocess.run(argv, cwd=REPO, env=ENV, capture_output=True, text=True,
                                timeout=30)
        assert result.returncode == 125 and "--hook-library" in result.stderr
        assert not state_dir.exists()
        return
    library = Path(hooklib.library_path())
    proc = subprocess.Popen(
        [sys.executable, "-m", "vgpu_runtime.run", "--state-dir", str(state_dir),
         "--simulate-gpus", "1", "--", sys.executable, "-c", PROBE, "0"],
        cwd=REPO, env=ENV, text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE)
    seen = probe_started(proc)
    assert seen["env"]["LD_PRELOAD"] == str(library.resolve())
    assert live_records(state_dir)[0].hook_library == library.name == hooklib.library_name()
    assert finish(proc)[0] == 0


def test_sigint_sent_with_kill_is_forwarded(state_dir: Path, hook_library: Path) -> None:
    proc = gemini_run(state_dir, hook_library, command=trap(signal.SIGINT, 5))
    probe_started(proc)
    proc.send_signal(signal.SIGINT)  # si_code SI_USER: not the terminal, so forwarded
    code, err = finish(proc)
    assert code == 5, err
    assert live_records(state_dir) == []


def test_shares_are_written_as_pod_annotations_are() -> None:
    """One grammar for fractions: --share and --limit take 0.3 or 30%, as the annotations do."""
    from vgpu_runtime.run import parse_args

    request = parse_args(["--share", "30%", "--limit", "0.5", "--", "true"])
    assert request.share == Share.of_slices(3, 10) and request.limit == Share.of_slices(1, 2)
