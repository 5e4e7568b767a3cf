"""The release before a wire version, from the repository's history: its hook built and its
daemon run, for the upgrade tests (a hook of that version keeps running in pods across the
daemon's upgrade; a daemon of that version is what a rollback meets).

The release is the commit before the one that introduced the next wire version (its first
parent; HEAD while that version is not committed yet), found with `git log -S` on the wire
header. Its `vgpu_runtime` is extracted with `git archive`; the hook is built with that tree's
own build.py (pure standard library), and the daemon runs from that tree.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from io import BytesIO
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# The wire header's places, newest first (it moved beside its Python reader in contracts/).
WIRE_HEADERS = ("vgpu_runtime/contracts/gemini_wire.h", "vgpu_runtime/hook/include/gemini_wire.h")


class NoOlderRelease(LookupError):
    """The history that holds the release is not here (no git, a shallow clone); says why."""


def _git(*args: str) -> bytes:
    if shutil.which("git") is None:
        raise NoOlderRelease("git is not installed")
    proc = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, timeout=60)
    if proc.returncode != 0:
        raise NoOlderRelease(f"git {' '.join(args)}: {proc.stderr.decode(errors='replace')}")
    return proc.stdout


def wire_version_at(commit: str) -> int:
    for place in WIRE_HEADERS:
        try:
            header = _git("show", f"{commit}:{place}").decode()
        except NoOlderRelease:
            continue
        match = re.search(r"^#define GM_WIRE_VERSION (\d+)", header, re.M)
        if match is None:
            raise NoOlderRelease(f"{place} at {commit} declares no GM_WIRE_VERSION")
        return int(match.group(1))
    raise NoOlderRelease(f"{commit} has no wire header at {' or '.join(WIRE_HEADERS)}")


def release_of_wire_version(version: int) -> str:
    """The commit of the last release that speaks wire `version`."""
    introduced = _git("log", "--reverse", "--format=%H", "-S",
                      f"#define GM_WIRE_VERSION {version + 1}", "HEAD", "--",
                      *WIRE_HEADERS).decode().split()
    commit = f"{introduced[0]}^" if introduced else "HEAD"
    try:
        found = wire_version_at(commit)
    except NoOlderRelease as err:
        raise NoOlderRelease(f"the commit before wire version {version + 1} is not in this "
                             f"clone (a shallow one?): {err}") from None
    if found != version:
        raise NoOlderRelease(f"{commit} speaks wire version {found}, not {version}")
    return _git("rev-parse", commit).decode().strip()


@dataclass(frozen=True)
class OlderRelease:
    commit: str
    root: Path        # holds that release's vgpu_runtime
    hook: Path        # its interposer, built from its sources

    def daemon_wrap(self) -> tuple[str, ...]:
        """DaemonProcess's `wrap`: the daemon's command run in `root`, where `python -m`
        imports that release's vgpu_runtime before the installed one."""
        return ("sh", "-c", 'cd "$0" && exec "$@"', str(self.root))


def extract(version: int, dest: Path) -> OlderRelease:
    """The last release of wire `version`, extracted under `dest` with its hook built;
    raises NoOlderRelease where the history is not here, HookBuildError's text on a failed
    build (as AssertionError)."""
    commit = release_of_wire_version(version)
    archive = _git("archive", "--format=tar", commit, "vgpu_runtime")
    root = dest / f"release-{commit[:12]}"
    root.mkdir(parents=True)
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(root, filter="data")
    build = subprocess.run([sys.executable, str(root / "vgpu_runtime/hook/build.py"),
                            str(dest / "lib")], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, f"building the hook of {commit}:\n{build.stderr}"
    return OlderRelease(commit, root, Path(build.stdout.strip().splitlines()[-1]))
