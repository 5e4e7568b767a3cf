"""Two real Unix users on one machine, over the real daemons, the real interposer and the fake
libcuda.

With the host daemon: both users' gemini-run go through it; shares and memory hold across them;
neither can stop, read or change the other's allocation; `gemini-vgpu status` shows each their
own and what is free; a user outside the group is told how to get in. Without it: the first
user's daemon holds the GPU host-wide and the second user's is refused, naming the holder.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests import sharedbuild
from tests.host.conftest import ENV, HostDaemon, Members, User, mode_of, wait_exit
from tests.scrape import free_port
from vgpu_runtime import gpulock
from vgpu_runtime.contracts import allocation, paths
from vgpu_runtime.devkit.daemon_process import wait_for
from vgpu_runtime.gpus.simulated import DEFAULT_MEMORY, simulated_uuid

GiB = 1 << 30
RUN_S = 2.5
KERNEL_NS = 1_000_000
UUID = simulated_uuid(0)

# A user's job, run by gemini-run under the interposer over the fake driver: it fills its memory
# limit but 64 MiB, is refused 128 MiB more, reports, waits for a line, launches 1 ms kernels
# for RUN_S seconds (a sync every 4), reports how many, and waits for a line to exit.
JOB = textwrap.dedent(f"""
    from tests.hook.cudaprobe import *
    import ctypes, json, os, sys, time
    lib = cuda()
    context(lib)
    limit = int(os.environ["GEMINI_VGPU_MEMORY_LIMIT"])
    free, total = mem_info(lib)
    rc_within, _ = alloc(lib, limit - (64 << 20))
    rc_past, _ = alloc(lib, 128 << 20)
    print(json.dumps({{"id": os.environ["GEMINI_ALLOCATION_ID"], "total": total,
                      "channel": os.environ["GEMINI_CHANNEL_DIR"],
                      "rc_within": rc_within, "rc_past": rc_past}}), flush=True)
    sys.stdin.readline()
    lib.fake_cuda_set_kernel_ns.argtypes = [ctypes.c_longlong]
    lib.fake_cuda_set_kernel_ns({KERNEL_NS})
    stream = ctypes.c_void_p(0x77)
    end = time.monotonic() + {RUN_S}
    kernels = 0
    while time.monotonic() < end:
        for _ in range(4):
            assert lib.cuLaunchKernel(None, 1, 1, 1, 1, 1, 1, 0, stream, None, None) == 0
        assert lib.cuStreamSynchronize(stream) == 0
        kernels += 4
    print(json.dumps({{"kernels": kernels}}), flush=True)
    sys.stdin.readline()
""")
# Holds its allocation until a line comes.
WAIT = "import json, os, sys; print(json.dumps(dict(os.environ)), flush=True); sys.stdin.readline()"


@pytest.fixture(scope="module")
def built() -> tuple[Path, Path]:
    """The interposer (strict) and the fake driver, in the run's directory every user may read
    (tests/sharedbuild.py)."""
    return sharedbuild.hook_library(), sharedbuild.fake_driver()


def job_env(fake: Path, **extra: str) -> dict[str, str]:
    return {**ENV, "LD_LIBRARY_PATH": str(fake), "FAKE_CUDA_UUIDS": UUID,
            "FAKE_CUDA_TOTAL_MEM": str(DEFAULT_MEMORY), "GEMINI_HOOK_DAEMON_WAIT": "5", **extra}


def gemini_run(user: User, library: Path, state_dir: Path | None, *args: str,
               code: str = WAIT, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    named = ["--state-dir", str(state_dir)] if state_dir else []
    return user.start([sys.executable, "-m", "vgpu_runtime.run", *named, "--hook-library",
                       str(library), *args, "--", sys.executable, "-c", code], env=env)


def line(proc: subprocess.Popen[str]) -> dict[str, Any]:
    assert proc.stdout is not None
    text = proc.stdout.readline()
    if not text:
        code, _out, err = wait_exit(proc)
        raise AssertionError(f"gemini-run exited {code}: {err}")
    result: dict[str, Any] = json.loads(text)
    return result


def go(proc: subprocess.Popen[str]) -> None:
    assert proc.stdin is not None
    proc.stdin.write("\n")
    proc.stdin.flush()


def vgpu(user: User, state_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return user.run([sys.executable, "-m", "vgpu_runtime.cli", *args, "--state-dir",
                     str(state_dir)], env={**ENV, "COLUMNS": "400"})


def python_as(user: User, code: str, caps: tuple[str, ...] = ("dac_read_search",)
              ) -> subprocess.CompletedProcess[str]:
    return subprocess.run(user.argv([sys.executable, "-c", textwrap.dedent(code)], caps),
                          capture_output=True, text=True, timeout=30, env=ENV,
                          cwd=str(Path(__file__).resolve().parents[2]))


@pytest.fixture
def host(members: Members, root_dir: Path) -> Iterator[HostDaemon]:
    daemon = HostDaemon(root_dir, members.group, "--simulate-gpus", "1").wait_ready()
    yield daemon
    daemon.stop()


def test_shares_and_memory_hold_across_two_users(members: Members, host: HostDaemon,
                                                 built: tuple[Path, Path]) -> None:
    library, fake = built
    state = host.state_dir
    alice = gemini_run(members.alice, library, state, "--share", "0.3", "--memory", "1GiB",
                       code=JOB, env=job_env(fake))
    bob = gemini_run(members.bob, library, state, "--share", "0.7", "--memory", "2GiB",
                     code=JOB, env=job_env(fake))
    try:
        a, b = line(alice), line(bob)
        # Memory: each limit holds for its own user, past it the interposer refuses.
        for seen, limit in ((a, GiB), (b, 2 * GiB)):
            assert seen["total"] == limit
            assert (seen["rc_within"], seen["rc_past"]) == (0, 2)   # CUDA_ERROR_OUT_OF_MEMORY
        everyone = host.status()
        owners = {e["id"]: e["owner_uid"] for e in everyone["allocations"]}
        assert owners == {a["id"]: members.alice.uid, b["id"]: members.bob.uid}
        # The GPU is full: a third allocation of either user is refused, the other's id unsaid.
        third = gemini_run(members.bob, library, state, "--share", "0.1")
        code, _out, err = wait_exit(third)
        assert code == 125 and "has 0 of its time" in err, err
        assert a["id"] not in err and "1 of other users: 0.3" in err
        assert "--overcommit cannot help" in err
        # Time: run together, each gets at least most of its share, alice less than bob.
        go(alice)
        go(bob)
        ran_a, ran_b = line(alice)["kernels"], line(bob)["kernels"]
        achieved = {name: kernels * KERNEL_NS / 1e9 / RUN_S
                    for name, kernels in (("alice", ran_a), ("bob", ran_b))}
        assert achieved["alice"] >= 0.6 * 0.3 and achieved["bob"] >= 0.6 * 0.7, achieved
        assert achieved["alice"] < achieved["bob"], achieved
        tenants = {t["allocation"]: t for t in host.status()["gpus"][0]["tenants"]}
        assert tenants[a["id"]]["achieved"] < tenants[b["id"]]["achieved"], tenants
        go(alice)
        go(bob)
        assert wait_exit(alice)[0] == 0 and wait_exit(bob)[0] == 0
    finally:
        alice.kill()
        bob.kill()
    # Each allocation ended with its gemini-run: no record, no channel.
    wait_for(lambda: host.status()["allocations"] == [], 5, "both allocations ended")
    assert os.listdir(paths.host_channels_dir(state)) == []


def test_memory_is_admitted_across_users(members: Members, host: HostDaemon,
                                         built: tuple[Path, Path]) -> None:
    library, _fake = built
    big = gemini_run(members.alice, library, host.state_dir, "--share", "0.2", "--memory",
                     "100GB")
    try:
        line(big)
        # 100 GB + 50 GB is past the GPU's 141 GB, though the shares (0.4) fit.
        for extra in ((), ("--overcommit",)):
            refused = gemini_run(members.bob, library, host.state_dir, "--share", "0.2",
                                 "--memory", "50GB", *extra)
            code, _out, err = wait_exit(refused)
            assert code == 125 and "of its memory free" in err, err
            assert "--overcommit cannot help" in err
        fits = gemini_run(members.bob, library, host.state_dir, "--share", "0.2", "--memory",
                          "40GB")
        line(fits)
        go(fits)
        assert wait_exit(fits)[0] == 0
        # Alice's --overcommit passes the bounds over her own allocations alone.
        mine = gemini_run(members.alice, library, host.state_dir, "--share", "0.9",
                          "--overcommit")
        line(mine)
        go(mine)
        assert wait_exit(mine)[0] == 0
    finally:
        go(big)
        wait_exit(big)


def test_neither_user_can_stop_read_or_change_the_others_allocation(
        members: Members, host: HostDaemon, built: tuple[Path, Path]) -> None:
    library, fake = built
    state = host.state_dir
    alice = gemini_run(members.alice, library, state, "--share", "0.4", "--memory", "1GiB",
                       code=JOB, env=job_env(fake))
    bob_job = gemini_run(members.bob, library, state, "--share", "0.3")
    try:
        seen = line(alice)
        line(bob_job)
        victim = seen["id"]
        channel = Path(seen["channel"])
        record = allocation.record_path(state, victim)
        bob = members.bob
        # Read: records, the channel directory's listing, nothing of it is bob's to see.
        for argv in (["cat", str(record)], ["ls", str(paths.allocations_dir(state))],
                     ["ls", str(paths.host_channels_dir(state))], ["ls", str(channel)]):
            result = bob.bare(argv)
            assert result.returncode != 0 and "Permission denied" in result.stderr, argv
        # Change: plant a record, remove alice's channel, replace her socket.
        for argv in (["touch", str(paths.allocations_dir(state) / "r-0000000000000000.json")],
                     ["rm", "-rf", str(channel)], ["rm", "-f", str(channel / "sched.sock")],
                     ["rm", "-f", str(paths.host_socket(state))]):
            assert bob.bare(argv).returncode != 0, argv
        assert mode_of(channel / "sched.sock") == (members.alice.uid, 0, 0o600)
        assert mode_of(channel) == (0, 0, 0o711)
        assert mode_of(paths.host_socket(state)) == (0, members.gid, 0o660)
        # Reach: her channel's socket is hers (connect needs write). With a capability that
        # passes file modes, the daemon still knows bob by his credentials and refuses him.
        probe = f"""
            import socket
            sock = socket.socket(socket.AF_UNIX)
            sock.settimeout(10)
            try:
                sock.connect({str(channel / "sched.sock")!r})
            except OSError as err:
                raise SystemExit(print(type(err).__name__, err))
            said = b""   # a refused client is sent one error frame, then the daemon closes
            while chunk := sock.recv(4096):
                said += chunk
            print(said.decode(errors="replace"))
        """
        assert python_as(bob, probe).stdout.startswith("PermissionError")
        refused = python_as(bob, probe, caps=("dac_override",)).stdout
        assert f"uid {bob.uid} is not the owner" in refused, refused
        # Stop: her allocation by its id, the daemon itself; nor signal her processes.
        release = f"""
            from vgpu_runtime.daemon.host.client import HostError, request
            for op, fields in (("release", {{"id": {victim!r}}}), ("stop", {{}})):
                try:
                    print(op, request({str(state)!r}, op, **fields))
                except HostError as err:
                    print(op, "refused:", err)
        """
        said = python_as(bob, release).stdout
        assert f"release refused: no allocation '{victim}' of yours" in said, said
        assert "stop refused:" in said and "systemctl stop gemini-host" in said
        stop = vgpu(bob, state, "stop")
        assert stop.returncode == 1 and "systemctl stop" in stop.stderr
        assert bob.bare(["kill", "-TERM", str(alice.pid)]).returncode != 0
        # Alice's allocation is whole, and her job runs on.
        entry = next(e for e in host.status()["allocations"] if e["id"] == victim)
        assert entry["gpus"][0]["memory_limit"] == GiB and entry["gpus"][0]["share"] == 0.4
        go(alice)
        assert line(alice)["kernels"] > 0
        go(alice)
        assert wait_exit(alice)[0] == 0
    finally:
        alice.kill()
        go(bob_job)
        wait_exit(bob_job)


def test_status_shows_each_user_theirs_and_what_is_free(
        members: Members, host: HostDaemon, built: tuple[Path, Path]) -> None:
    library, _fake = built
    state = host.state_dir
    jobs = {members.alice.name: gemini_run(members.alice, library, state, "--share", "0.3",
                                           "--memory", "10GB"),
            members.bob.name: gemini_run(members.bob, library, state, "--share", "0.5",
                                         "--memory", "20GB")}
    try:
        ids = {name: line(proc)["GEMINI_ALLOCATION_ID"] for name, proc in jobs.items()}
        for user, other, share, other_share in ((members.alice, members.bob, 0.3, 0.5),
                                                (members.bob, members.alice, 0.5, 0.3)):
            shown = vgpu(user, state, "status", "--json")
            assert shown.returncode == 0, shown.stderr
            status = json.loads(shown.stdout)
            assert [a["id"] for a in status["allocations"]] == [ids[user.name]]
            gpu = status["gpus"][0]
            assert [t["allocation"] for t in gpu["tenants"]] == [ids[user.name]]
            assert gpu["tenants"][0]["request"] == pytest.approx(share)
            assert gpu["others"]["allocations"] == 1
            assert gpu["others"]["request"] == pytest.approx(other_share)
            assert ids[other.name] not in shown.stdout
            free = status["node"]["gpus"][0]
            assert free["share_allocated"] == pytest.approx(0.8)
            assert free["memory_allocated"] == 30 * 1000**3
            text = vgpu(user, state, "status")
            assert text.returncode == 0, text.stderr
            assert f"shown to uid {user.uid}: your allocations, and what is free" in text.stdout
            assert "FREE MEMORY" in text.stdout and "0.20" in text.stdout
            assert f"other users: 1 allocation(s), request {other_share:.2f}" in text.stdout
            assert ids[user.name] in text.stdout and ids[other.name] not in text.stdout
            assert f"uid {user.uid} pid" in text.stdout
            assert "metrics: off (the host daemon's --metrics-port" in text.stdout
        # Root sees everyone's.
        everyone = host.status()
        assert {a["id"] for a in everyone["allocations"]} == set(ids.values())
        # A user outside the group is told why and how to get in.
        outsider = members.outsider
        refused = gemini_run(outsider, library, state, "--share", "0.1")
        code, _out, err = wait_exit(refused)
        assert code == 125 and f"group {members.group!r}" in err and "usermod -aG" in err, err
        shown = vgpu(outsider, state, "status")
        assert shown.returncode == 1 and "usermod -aG" in shown.stderr
    finally:
        for proc in jobs.values():
            go(proc)
            wait_exit(proc)


def test_status_tells_every_user_where_the_host_daemons_metrics_are(
        members: Members, root_dir: Path) -> None:
    """The port, as the README documents it, for root and for a member alike: host.json says
    it to everyone already."""
    port = free_port()
    daemon = HostDaemon(root_dir, members.group, "--simulate-gpus", "1", "--metrics-port",
                        str(port)).wait_ready()
    try:
        line = (f"metrics: http://127.0.0.1:{port}/metrics (the host daemon's, for the "
                "operator: every user's allocations)")
        as_root = subprocess.run([sys.executable, "-m", "vgpu_runtime.cli", "status",
                                  "--state-dir", str(daemon.state_dir)], capture_output=True,
                                 text=True, timeout=30, env={**ENV, "COLUMNS": "400"})
        assert as_root.returncode == 0 and line in as_root.stdout, as_root.stderr
        shown = vgpu(members.alice, daemon.state_dir, "status")
        assert shown.returncode == 0, shown.stderr
        assert "shown to uid" in shown.stdout and line in shown.stdout, shown.stdout
        answer = json.loads(vgpu(members.alice, daemon.state_dir, "status", "--json").stdout)
        assert answer["daemon"]["metrics"] == {"address": "127.0.0.1", "asked": port,
                                               "port": port, "error": None}
    finally:
        assert daemon.stop() == 0, daemon.logs()


def test_a_killed_gemini_run_ends_its_allocation_and_a_restart_keeps_the_live_ones(
        members: Members, host: HostDaemon, root_dir: Path, built: tuple[Path, Path]) -> None:
    library, _fake = built
    state = host.state_dir
    killed = gemini_run(members.bob, library, state, "--share", "0.5")
    kept = gemini_run(members.alice, library, state, "--share", "0.5")
    gone, live = line(killed)["GEMINI_ALLOCATION_ID"], line(kept)["GEMINI_ALLOCATION_ID"]
    killed.send_signal(signal.SIGKILL)   # no release: the kernel closes its lease
    killed.wait(10)
    assert killed.stdin is not None
    killed.stdin.close()                 # its orphaned command exits
    wait_for(lambda: [a["id"] for a in host.status()["allocations"]] == [live], 5,
             "the killed run's allocation ended")
    # The daemon restarts: the live allocation is served again, and still ends with its run.
    assert host.stop() == 0
    again = HostDaemon(root_dir, members.group, "--simulate-gpus", "1").wait_ready()
    try:
        wait_for(lambda: [a["id"] for a in again.status()["allocations"]] == [live], 5,
                 "the live allocation served again")
        go(kept)
        assert wait_exit(kept)[0] == 0
        wait_for(lambda: again.status()["allocations"] == [], 5, "its end after the restart")
    finally:
        kept.kill()
        again.stop()
    assert gone not in os.listdir(paths.host_channels_dir(state))


def test_a_users_own_daemon_is_refused_a_gpu_the_host_daemon_serves(
        members: Members, host: HostDaemon, root_dir: Path, built: tuple[Path, Path]) -> None:
    library, _fake = built
    own = root_dir / f"own-{members.alice.name}"
    own.mkdir(mode=0o700)
    os.chown(own, members.alice.uid, members.alice.gid)
    refused = gemini_run(members.alice, library, own, "--simulate-gpus", "1",
                         env={**ENV, paths.ENV_GPU_LOCK_DIR: str(root_dir / "locks")})
    code, _out, err = wait_exit(refused)
    assert code == 125 and "served by the host daemon" in err, err


# ---- without the host daemon: a host-wide lock per GPU ----

@pytest.fixture
def own_dirs(members: Members, root_dir: Path) -> Iterator[dict[str, dict[str, str]]]:
    """Each user's XDG_RUNTIME_DIR (their default state directory under it) and the lock
    directory, as each user's environment; their daemons stopped after."""
    envs = {}
    for user in (members.alice, members.bob):
        runtime = root_dir / f"x{user.uid}"
        runtime.mkdir(mode=0o700)
        os.chown(runtime, user.uid, user.gid)
        envs[user.name] = {**ENV, "XDG_RUNTIME_DIR": str(runtime),
                           paths.ENV_GPU_LOCK_DIR: str(root_dir / "locks")}
    yield envs
    from tests.run.conftest import stop_daemon

    for env in envs.values():
        stop_daemon(Path(env["XDG_RUNTIME_DIR"]) / "gemini")


def test_a_second_users_daemon_is_refused_naming_the_holder(
        members: Members, root_dir: Path, own_dirs: dict[str, dict[str, str]],
        built: tuple[Path, Path]) -> None:
    library, _fake = built
    alice, bob = members.alice, members.bob
    holder = gemini_run(alice, library, None, "--simulate-gpus", "2", "--gpu", "0",
                        env=own_dirs[alice.name])
    try:
        assert line(holder)["CUDA_VISIBLE_DEVICES"] == UUID
        lock = gpulock.lock_file(root_dir / "locks", UUID)
        assert mode_of(lock) == (alice.uid, alice.gid, 0o444)
        # Bob's gemini-run is refused GPU 0 at once, told whose it is and what to do.
        for args in (("--simulate-gpus", "1"), ("--simulate-gpus", "2", "--gpu", "0")):
            refused = gemini_run(bob, library, None, *args, env=own_dirs[bob.name])
            code, _out, err = wait_exit(refused)
            assert code == 125, err
            assert f"uid {alice.uid} ({alice.name})" in err and "alone" in err, err
            assert "gemini-host install" in err
        # By default he gets the GPU nobody holds.
        other = gemini_run(bob, library, None, "--simulate-gpus", "2", env=own_dirs[bob.name])
        assert line(other)["CUDA_VISIBLE_DEVICES"] == simulated_uuid(1)
        go(other)
        assert wait_exit(other)[0] == 0
        # Alice's lock file cannot be removed or replaced by bob (a sticky directory).
        for argv in (["rm", "-f", str(lock)], ["mv", str(lock), str(lock) + ".x"]):
            assert bob.bare(argv).returncode != 0, argv
        # Bob's own daemon (idle now) refuses a record on alice's GPU, whoever wrote it, and
        # gemini-run reads the refusal from it.
        race = f"""
            import os, time
            from pathlib import Path
            from vgpu_runtime import run
            from vgpu_runtime.devkit.daemon_process import make_record
            state = Path(os.environ["XDG_RUNTIME_DIR"]) / "gemini"
            record = make_record(state, origin="gemini-run", owner_pid=os.getpid(),
                                 gpus=(({UUID!r}, 1 << 30, 0.5),))
            for _ in range(100):
                said = run.daemon_refusal(state, record)
                if said:
                    break
                time.sleep(0.05)
            print(said)
        """
        said = subprocess.run(bob.argv([sys.executable, "-c", textwrap.dedent(race)]),
                              capture_output=True, text=True, timeout=30,
                              env=own_dirs[bob.name]).stdout
        assert f"is held by uid {alice.uid}" in said, said
    finally:
        go(holder)
        wait_exit(holder)
    # Alice's allocation ended: her daemon lets the GPU go, and bob takes it.
    def bob_runs() -> bool:
        proc = gemini_run(bob, library, None, "--simulate-gpus", "1", env=own_dirs[bob.name])
        assert proc.stdout is not None
        if not proc.stdout.readline():   # refused: alice's daemon has not let it go yet
            return wait_exit(proc)[0] == 0
        go(proc)
        return wait_exit(proc)[0] == 0
    wait_for(bob_runs, 10, "bob's run on the GPU alice released")


def test_concurrent_claims_of_two_users_leave_one_holder(members: Members,
                                                         root_dir: Path) -> None:
    # Each claims on "go" (all started: a real race) and holds its claim until its stdin
    # closes (a process's claims end with it), so no claim ends before all have tried.
    claim = f"""
        import os, sys
        from vgpu_runtime import gpulock
        claims = gpulock.GpuClaims({str(root_dir / "locks")!r}, os.geteuid())
        print("ready", flush=True)
        sys.stdin.readline()
        try:
            claims.claim("GPU-race")
            print("won", flush=True)
        except gpulock.GpuHeld:
            print("held", flush=True)
        sys.stdin.read()
    """
    procs = [(user, subprocess.Popen(
        user.argv([sys.executable, "-c", textwrap.dedent(claim)]), env=ENV,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
        for user in (members.alice, members.bob) * 4]
    for _, proc in procs:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    for _, proc in procs:
        assert proc.stdin is not None
        proc.stdin.write("go\n")
        proc.stdin.flush()
    results = [(user.name, proc.stdout.readline().strip())   # type: ignore[union-attr]
               for user, proc in procs]
    for _, proc in procs:
        assert proc.communicate(timeout=30)[0] == "" and proc.returncode == 0
    winners = {name for name, said in results if said == "won"}
    assert len(winners) == 1, results   # one user's daemons hold it, the other's are refused
    assert all(said == ("won" if name in winners else "held") for name, said in results)


def test_the_host_daemon_makes_a_users_lock_file_roots(members: Members,
                                                       root_dir: Path) -> None:
    # Alice's daemon made GPU 0's lock file before the host daemon was installed: she could
    # remove it and lock a new one beside the host daemon, so the host daemon replaces it.
    made = python_as(members.alice, f"""
        from vgpu_runtime import gpulock
        gpulock.GpuClaims({str(root_dir / "locks")!r}, {members.alice.uid}).claim({UUID!r})
    """)
    assert made.returncode == 0, made.stderr
    lock = gpulock.lock_file(root_dir / "locks", UUID)
    assert mode_of(lock)[0] == members.alice.uid
    daemon = HostDaemon(root_dir, members.group, "--simulate-gpus", "1").wait_ready()
    try:
        assert mode_of(lock) == (0, 0, 0o444)
        assert members.alice.bare(["rm", "-f", str(lock)]).returncode != 0
        found = gpulock.holder(root_dir / "locks", UUID, members.alice.uid)
        assert found is not None and found.is_host and found.pid == daemon.proc.pid
    finally:
        daemon.stop()
