"""A6: root in a container holds a descriptor of its token page (every hello passes one) and
tries to write it, to forge `valid_until_ns` and launch without the daemon's grant.

The page is a memfd the daemon sealed with F_SEAL_FUTURE_WRITE after mapping it (pages.py):
reopening it for writing through /proc works (a memfd's mode lets anyone), but no write(), no
new writable mapping, no mprotect of the hook's mapping, no resize, no hole and no new seal
succeeds, for root too, from inside the pod or from the host. The hook still reads the page and
the daemon still writes it. On a kernel without the seal the page is a file, and the same root
forges it: the second test shows the hole the seal closes (and what such a node keeps, A6 in
RELIABILITY.md).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from tests.hook.conftest import PRELUDE, DaemonNode, Hooked, start_inprocess_node, stop_node
from tests.hook.tokenkit import in_pod
from tests.security import forgery
from vgpu_runtime.daemon.channel import pages

pytestmark = pytest.mark.skipif(shutil.which("unshare") is None or os.geteuid() != 0,
                                reason="needs root and unshare(1): the attacker is root in a pod")

LAUNCH_SECONDS = 1.0   # several quotas: an honest page makes the hook ask again

# In the pod, as root: the hook maps its page at the first launch; then a hello of the
# attacker's own brings a descriptor of the same page, which it attacks by every route, the
# hook's own mapping (map_files) included. The test attacks from the host meanwhile. Then it
# launches for several quotas: a forged page would pass them all without a token request.
ATTACKER = """
    import sys, time
    from tests.security import forgery
    from vgpu_runtime.daemon.channel.client import ChannelClient
    lib = cuda()
    context(lib)
    lib.cuLaunchKernel(None, 1, 1, 1, 1, 1, 1, 0, None, None, None)
    client = ChannelClient("/run/gemini/sched.sock")
    client.hello()
    token_fd = client.page_fds[0]
    hook_map = next(line.split()[0] for line in open("/proc/self/maps")
                    if ".token." in line and line.split()[1] == "r--s")
    inside = forgery.attempts(f"/proc/self/fd/{token_fd}", token_fd)
    forged = forgery.forged(token_fd)
    mapped = forgery.attempts(f"/proc/self/map_files/{hook_map}")
    print(json.dumps({"pid": os.getpid(), "fd": token_fd, "inside": inside, "forged": forged,
                      "map_files": mapped}), flush=True)
    sys.stdin.readline()
    forged_outside = forgery.forged(token_fd)
    end = time.monotonic() + LAUNCH_SECONDS
    while time.monotonic() < end:
        lib.cuLaunchKernel(None, 1, 1, 1, 1, 1, 1, 0, None, None, None)
    after = stats()
    grant = client.request_token(0)
    page = client.token_page(0)
    print(json.dumps({
        "forged_outside": forged_outside,
        "ungated": after["ungated_launches"], "valid_until": forgery.read_valid_until(token_fd),
        "now": time.monotonic_ns(), "grant_valid_until": grant.valid_until_ns,
        "page_after_grant": page.valid_until_ns, "magic": page.page.magic}), flush=True)
""".replace("LAUNCH_SECONDS", str(LAUNCH_SECONDS))


def attack(hooked: Hooked, node: DaemonNode) -> tuple[dict[str, object], dict[str, str],
                                                      dict[str, object]]:
    """The pod's attempts, the host's on /proc/<pid>/fd/<n> of the pod's process, and what
    the pod's launches and the daemon did afterwards."""
    env = node.env_of(node.record)
    env["GEMINI_CHANNEL_DIR"] = "/run/gemini"
    argv = [sys.executable, "-c", PRELUDE + textwrap.dedent(ATTACKER)]
    proc = subprocess.Popen(in_pod(node.record.channel_dir, argv), env=hooked.env(env),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        first = Hooked.line(proc)
        outside = forgery.attempts(f"/proc/{first['pid']}/fd/{first['fd']}")
        then = Hooked.line(proc, go=True)
        assert proc.wait(30) == 0, proc.stderr.read() if proc.stderr else ""
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return first, outside, then


@pytest.fixture
def contended() -> DaemonNode:
    """Two allocations of 0.5 on one GPU: launches need the token."""
    node = start_inprocess_node(0.5)
    node.allocate(0.5)
    return node


def test_root_in_a_pod_cannot_write_its_sealed_token_page_by_any_route(
        hooked: Hooked, contended: DaemonNode) -> None:
    if pages.sealing_unavailable():
        pytest.skip(f"this kernel cannot seal token pages: {pages.sealing_unavailable()}")
    try:
        assert contended.daemon.status()["daemon"]["token_pages"] == "sealed"
        first, outside, then = attack(hooked, contended)
    finally:
        stop_node(contended)
    refused = ("EPERM", "EACCES", "EBADF")
    for route in ("inside", "map_files"):
        results = first[route]
        assert isinstance(results, dict)
        # The reopen itself works (a memfd's mode is 0777); nothing written through it does.
        assert results.pop("reopen O_RDWR") == "ok", (route, results)
        assert results and all(v in refused for v in results.values()), json.dumps([route, results])
    assert outside.pop("reopen O_RDWR") == "ok", outside
    assert outside and all(v in refused for v in outside.values()), outside
    # Nothing was forged: the hook's launches went gated, and the daemon still writes the
    # page the hook reads.
    assert first["forged"] is False and then["forged_outside"] is False, (first, then)
    valid_until, now = then["valid_until"], then["now"]
    assert isinstance(valid_until, int) and isinstance(now, int)
    assert valid_until < now + 60 * 10**9, then
    assert then["ungated"] == 0, then
    assert then["page_after_grant"] == then["grant_valid_until"], then
    assert then["magic"] == 1196250187, then


def test_without_the_seal_root_in_a_pod_forges_its_file_token_page(
        hooked: Hooked, monkeypatch: pytest.MonkeyPatch) -> None:
    """What a node whose kernel lacks F_SEAL_FUTURE_WRITE keeps (the daemon warns at start):
    the same root reopens the read-only file page for writing and launches on a forged grant
    without asking. The first test's assertions fail on such a page."""
    monkeypatch.setattr(pages, "sealing_unavailable", lambda: "a kernel without the seal")
    node = start_inprocess_node(0.5)
    node.allocate(0.5)
    try:
        assert node.daemon.status()["daemon"]["token_pages"] == "file"
        first, outside, then = attack(hooked, node)
    finally:
        stop_node(node)
    inside = first["inside"]
    assert isinstance(inside, dict)
    assert inside["reopen O_RDWR"] == "ok" and inside["pwrite"] == "ok", inside
    assert inside["mprotect writable"] == "EACCES", inside   # the hook's own mapping holds
    assert first["forged"] is True, first
    assert outside["reopen O_RDWR"] == "ok" and outside["pwrite"] == "ok", outside
    assert then["forged_outside"] is True, then

