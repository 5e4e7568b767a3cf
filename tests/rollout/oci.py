"""The node image's containers under runc: a built image's root filesystem, a minimal OCI spec.

Small and self-contained on purpose (the DaemonSet's four containers only): `podman run`
fails on this kind of machine with an rlimit error while plain runc works, so the image's
layers are mounted by podman (`podman image mount`: a directory, of overlay or vfs) and run by
runc.
Each container gets what the DaemonSet gives it: a read-only root, no capabilities, no new
privileges, its own pid/ipc/uts/mount namespaces, the host's network, a small /tmp, and host
directories bind-mounted at the same paths (Allocate's answers name host paths).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

NO_CAPABILITIES: dict[str, list[str]] = {
    "bounding": [], "effective": [], "inheritable": [], "permitted": [], "ambient": []}


def runtime_available() -> str | None:
    """None when runc can run containers here; otherwise why not."""
    if shutil.which("runc") is None:
        return "runc is not installed (apt-get install runc)"
    return None


def spec(rootfs: Path, args: Sequence[str], env: Sequence[str],
         binds: Sequence[tuple[Path, bool]]) -> dict[str, Any]:
    """An OCI runtime spec: binds are (host path, writable), mounted at the same path."""
    mounts: list[dict[str, Any]] = [
        {"destination": "/proc", "type": "proc", "source": "proc"},
        {"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
         "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
        {"destination": "/sys", "type": "sysfs", "source": "sysfs",
         "options": ["nosuid", "noexec", "nodev", "ro"]},
        {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs",
         "options": ["nosuid", "nodev", "mode=1777", "size=16m"]},
    ]
    for path, writable in binds:
        mounts.append({"destination": str(path), "type": "bind", "source": str(path),
                       "options": ["rbind", "rw" if writable else "ro"]})
    return {
        "ociVersion": "1.0.2",
        "process": {"terminal": False, "user": {"uid": 0, "gid": 0}, "args": list(args),
                    "env": list(env), "cwd": "/", "capabilities": NO_CAPABILITIES,
                    "noNewPrivileges": True,
                    "rlimits": [{"type": "RLIMIT_NOFILE", "hard": 4096, "soft": 4096}]},
        "root": {"path": str(rootfs), "readonly": True},
        "hostname": "gemini-node",
        "mounts": mounts,
        "linux": {"namespaces": [{"type": t} for t in ("pid", "ipc", "uts", "mount")],
                  "maskedPaths": ["/proc/kcore", "/proc/keys", "/proc/timer_list"],
                  "readonlyPaths": ["/proc/sys", "/proc/sysrq-trigger"]},
    }


@dataclass
class Runc:
    """Containers of one test under a private runc state root."""

    root: Path
    rootfs: Path
    env: Sequence[str]
    running: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    logs: dict[str, Path] = field(default_factory=dict)

    def _bundle(self, name: str, args: Sequence[str], binds: Sequence[tuple[Path, bool]]) -> Path:
        bundle = self.root / "bundles" / name
        bundle.mkdir(parents=True)
        (bundle / "config.json").write_text(json.dumps(spec(self.rootfs, args, self.env, binds)))
        return bundle

    def _command(self, name: str, bundle: Path) -> list[str]:
        return ["runc", "--root", str(self.root / "state"), "run", "--bundle", str(bundle),
                f"{self.root.name}-{name}"]

    def _log(self, name: str) -> IO[bytes]:
        self.logs[name] = self.root / f"{name}.log"
        return open(self.logs[name], "wb")

    def run(self, name: str, args: Sequence[str], binds: Sequence[tuple[Path, bool]],
            timeout: float = 60) -> tuple[int, str]:
        """Run to completion; (exit status, its output)."""
        bundle = self._bundle(name, args, binds)
        with self._log(name) as log:
            code = subprocess.run(self._command(name, bundle), stdin=subprocess.DEVNULL,
                                  stdout=log, stderr=subprocess.STDOUT, timeout=timeout).returncode
        return code, self.output(name)

    def start(self, name: str, args: Sequence[str],
              binds: Sequence[tuple[Path, bool]]) -> None:
        bundle = self._bundle(name, args, binds)
        with self._log(name) as log:
            self.running[name] = subprocess.Popen(self._command(name, bundle),
                                                  stdin=subprocess.DEVNULL, stdout=log,
                                                  stderr=subprocess.STDOUT)

    def output(self, name: str) -> str:
        return self.logs[name].read_text(errors="replace") if name in self.logs else ""

    def alive(self, name: str) -> bool:
        return self.running[name].poll() is None

    def stop(self, name: str, timeout: float = 10) -> int:
        """SIGTERM as kubelet sends it, then SIGKILL; returns the container's exit status."""
        proc = self.running.pop(name)
        container = f"{self.root.name}-{name}"
        state = ["runc", "--root", str(self.root / "state")]
        if proc.poll() is None:
            subprocess.run([*state, "kill", container, "TERM"], capture_output=True)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                subprocess.run([*state, "kill", container, "KILL"], capture_output=True)
                proc.wait(timeout)
        subprocess.run([*state, "delete", "--force", container], capture_output=True)
        return proc.returncode

    def stop_all(self) -> None:
        for name in list(self.running):
            self.stop(name)


@contextlib.contextmanager
def mounted_image(podman: Sequence[str], image: str) -> Iterator[Path]:
    """The image's root filesystem as a directory, for as long as the block runs."""
    path = subprocess.run([*podman, "image", "mount", image], capture_output=True, text=True,
                          check=True).stdout.strip()
    try:
        yield Path(path)
    finally:
        for _ in range(3):
            if subprocess.run([*podman, "image", "unmount", image],
                              capture_output=True).returncode == 0:
                break
            time.sleep(0.5)
