"""The emulator's container runtime stage: an Allocate response run in a real OCI container.

For each admitted container it does what containerd's CRI plugin (and, for CDI names, a
CDI-aware runtime) does with a ContainerAllocateResponse, writes the OCI runtime spec and runs
it with runc:

- each `Mount` becomes a bind mount (`rbind`, plus `ro` when read_only), in the response's order;
- `Envs` become the process environment; the pod's own env comes after them and wins, as
  kubelet appends the pod's variables to the device plugin's;
- each `DeviceSpec` becomes a device node (type, major and minor read from its host path) and a
  device cgroup rule with its permissions, after a deny-all rule;
- each CDI name (`vendor/class=device`) is resolved in the CDI specs of `cdi_dir`: the spec's
  own containerEdits, then the device's (env, deviceNodes, mounts). An unknown name, or an
  edit this stage cannot apply (hooks), is refused with the reason, never skipped;
- the process runs as a non-root uid, without capabilities, in its own mount, pid, ipc, uts
  and network namespaces, on a read-only rootfs that holds only the container side: host
  system directories bound read-only (or the host's whole root, `Rootfs.host_root`, where the
  container's programs live elsewhere, e.g. PyTorch on the GPU machine), /tmp, and the volumes
  the test gives it. Nothing of the project: the hook arrives only through the response.

runc is `$GEMINI_TEST_RUNC` when set (the GPU machine carries Debian's runc unpacked with
`dpkg -x`), otherwise `runc` on PATH. `runc_refusal()` says why containers cannot run here.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import queue
import re
import shutil
import stat
import subprocess
import tempfile
import threading
import time
import types
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

RUNC_ENV = "GEMINI_TEST_RUNC"
CONTAINER_UID = 1000   # most pods run as some non-root uid; nothing on the host owns this one
# Top-level host entries a rootfs of system directories takes (symlinks stay symlinks).
SYSTEM_DIRS = ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "etc")
# Never bound from the host, even for host_root: the container gets its own.
OWN_DIRS = ("proc", "sys", "dev", "tmp", "run", "var")
# containerd's default bounding set (pkg/oci/spec.go); a non-root process keeps none effective.
DEFAULT_CAPABILITIES = (
    "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FSETID", "CAP_FOWNER", "CAP_MKNOD", "CAP_NET_RAW",
    "CAP_SETGID", "CAP_SETUID", "CAP_SETFCAP", "CAP_SETPCAP", "CAP_NET_BIND_SERVICE",
    "CAP_SYS_CHROOT", "CAP_KILL", "CAP_AUDIT_WRITE")
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_ENV_NAME = re.compile(r"^[^=\0]+$")
_CDI_NAME = re.compile(r"^([a-z0-9][-a-z0-9.]*/[a-zA-Z0-9][-a-zA-Z0-9_.]*)=([a-zA-Z0-9_.:-]+)$")


class SpecError(ValueError):
    """The response (or a CDI spec) holds something this runtime cannot give a container."""


# ---- the pod side of a container ----

@dataclass(frozen=True)
class Volume:
    """A pod volume: a host directory at `container_path`."""
    host_path: str
    container_path: str
    read_only: bool = False


@dataclass(frozen=True)
class Rootfs:
    """What the container's root holds besides the response's mounts and the pod's volumes."""
    host_root: bool = False   # every top-level host directory read-only, not only SYSTEM_DIRS
    exclude: tuple[str, ...] = ()   # top-level host directories left out (with host_root)

    def entries(self) -> list[str]:
        if not self.host_root:
            return [name for name in SYSTEM_DIRS if os.path.lexists(f"/{name}")]
        return sorted(name for name in os.listdir("/")
                      if name not in OWN_DIRS and name not in self.exclude
                      and (os.path.isdir(f"/{name}") or os.path.islink(f"/{name}")))


SYSTEM_ROOTFS = Rootfs()


@dataclass(frozen=True)
class ContainerConfig:
    """What the pod spec says of a container: its command, env, user and volumes."""
    args: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)
    uid: int = CONTAINER_UID
    gid: int = CONTAINER_UID
    volumes: tuple[Volume, ...] = ()
    cwd: str = "/"
    rootfs: Rootfs = SYSTEM_ROOTFS


# ---- CDI ----

def _cdi_specs(cdi_dir: Path | None) -> dict[str, dict[str, Any]]:
    """kind -> spec, from every *.json CDI spec file in cdi_dir."""
    specs: dict[str, dict[str, Any]] = {}
    if cdi_dir is None:
        return specs
    for path in sorted(cdi_dir.glob("*.json")):
        spec = json.loads(path.read_text())
        kind = spec.get("kind")
        if not isinstance(kind, str) or kind in specs:
            raise SpecError(f"CDI spec {path}: kind {kind!r} missing or given twice")
        specs[kind] = spec
    return specs


def cdi_edits(names: Sequence[str], cdi_dir: Path | None) -> list[dict[str, Any]]:
    """The containerEdits that CDI device `names` bring, in the order a CDI runtime applies."""
    specs = _cdi_specs(cdi_dir)
    edits: list[dict[str, Any]] = []
    applied_kinds: set[str] = set()
    for name in names:
        match = _CDI_NAME.match(name)
        if match is None:
            raise SpecError(f"CDI device name {name!r} is not <vendor>/<class>=<device>")
        kind, device = match.groups()
        spec = specs.get(kind)
        if spec is None:
            raise SpecError(f"unresolvable CDI devices {name}: no CDI spec of kind {kind} in "
                            f"{cdi_dir}")
        found = [d for d in spec.get("devices", []) if d.get("name") == device]
        if not found:
            raise SpecError(f"unresolvable CDI devices {name}: kind {kind} has no device "
                            f"{device!r}")
        if kind not in applied_kinds:
            applied_kinds.add(kind)
            edits.append(spec.get("containerEdits") or {})
        edits.append(found[0].get("containerEdits") or {})
    for edit in edits:
        unknown = set(edit) - {"env", "deviceNodes", "mounts"}
        if unknown:
            raise SpecError(f"CDI containerEdits {sorted(unknown)} are not supported by this "
                            "runtime")
    return edits


# ---- the OCI spec ----

def _absolute(path: str, what: str) -> str:
    if not path.startswith("/") or "\0" in path:
        raise SpecError(f"{what} {path!r} must be an absolute path without NUL")
    normal = os.path.normpath(path)
    if normal == "/":
        raise SpecError(f"{what} {path!r}: refusing to mount over /")
    return normal


def _bind(host: str, container: str, read_only: bool, what: str) -> dict[str, Any]:
    options = ["rbind", "rprivate", "nosuid", "nodev"]
    if read_only:
        options.append("ro")
    return {"destination": _absolute(container, f"{what} container_path"), "type": "bind",
            "source": _absolute(host, f"{what} host_path"), "options": options}


def _device(path: str, host_path: str, permissions: str,
            given: Mapping[str, Any] | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """An OCI device and its cgroup rule; type/major/minor from `given` or the host node."""
    if not permissions or set(permissions) - set("rwm"):
        raise SpecError(f"device {path}: permissions {permissions!r} are not a subset of 'rwm'")
    given = given or {}
    if "major" in given and "minor" in given:
        kind, major, minor = str(given.get("type", "c")), int(given["major"]), int(given["minor"])
    else:
        try:
            info = os.stat(host_path)
        except OSError as err:
            raise SpecError(f"device {path}: host node {host_path}: {err.strerror}") from None
        if stat.S_ISCHR(info.st_mode):
            kind = "c"
        elif stat.S_ISBLK(info.st_mode):
            kind = "b"
        else:
            raise SpecError(f"device {path}: host path {host_path} is not a device node")
        major, minor = os.major(info.st_rdev), os.minor(info.st_rdev)
    mode = int(given.get("fileMode", 0o666))
    device = {"path": _absolute(path, "device container_path"), "type": kind, "major": major,
              "minor": minor, "fileMode": mode, "uid": 0, "gid": 0}
    rule = {"allow": True, "type": kind, "major": major, "minor": minor, "access": permissions}
    return device, rule


def _env_list(env: Mapping[str, str]) -> list[str]:
    for name in env:
        if not _ENV_NAME.match(name):
            raise SpecError(f"environment variable name {name!r} is not valid")
    return [f"{k}={v}" for k, v in env.items()]


def oci_spec(response: Any, config: ContainerConfig, cdi_dir: Path | None = None,
             hostname: str = "container") -> dict[str, Any]:
    """The OCI runtime spec (config.json) for a container given `response` by Allocate."""
    if not config.args:
        raise SpecError("no command to run in the container")
    if config.uid == 0:
        raise SpecError("the container process must run as a non-root uid")
    env: dict[str, str] = {"PATH": DEFAULT_PATH, "HOME": "/tmp"}
    mounts: list[dict[str, Any]] = []
    devices: list[dict[str, Any]] = []
    rules: list[dict[str, Any]] = [{"allow": False, "access": "rwm"}]
    for mount in response.mounts:
        mounts.append(_bind(mount.host_path, mount.container_path, bool(mount.read_only),
                            "mount"))
    for spec in response.devices:
        device, rule = _device(spec.container_path, _absolute(spec.host_path, "device host_path"),
                               spec.permissions or "rwm")
        devices.append(device)
        rules.append(rule)
    env.update(response.envs)
    for edit in cdi_edits([d.name for d in response.cdi_devices], cdi_dir):
        for entry in edit.get("env", []):
            name, equals, value = str(entry).partition("=")
            if not equals:
                raise SpecError(f"CDI env entry {entry!r} is not NAME=VALUE")
            env[name] = value
        for node in edit.get("deviceNodes", []):
            path = str(node["path"])
            device, rule = _device(path, str(node.get("hostPath", path)),
                                   str(node.get("permissions", "rwm")), node)
            devices.append(device)
            rules.append(rule)
        for mount in edit.get("mounts", []):
            options = list(mount.get("options", []))
            mounts.append(_bind(str(mount["hostPath"]), str(mount["containerPath"]),
                                "ro" in options, "CDI mount"))
    env.update(config.env)   # the pod's own env comes last and wins, as in kubelet
    for volume in config.volumes:
        mounts.append(_bind(volume.host_path, volume.container_path, volume.read_only,
                            "volume"))
    destinations = [m["destination"] for m in mounts] + [d["path"] for d in devices]
    for path in destinations:
        if destinations.count(path) > 1:
            raise SpecError(f"container path {path} is given twice")
    system_binds, _links = rootfs_layout(config.rootfs, destinations)
    system = [{"destination": path, "type": "bind", "source": path,
               "options": ["rbind", "rprivate", "nosuid", "ro"]} for path in system_binds]
    return {
        "ociVersion": "1.0.2",
        "process": {
            "terminal": False,
            "user": {"uid": config.uid, "gid": config.gid},
            "args": list(config.args),
            "env": _env_list(env),
            "cwd": config.cwd,
            "capabilities": {"bounding": list(DEFAULT_CAPABILITIES), "effective": [],
                             "permitted": [], "inheritable": [], "ambient": []},
            "noNewPrivileges": True,
            "rlimits": [{"type": "RLIMIT_NOFILE", "hard": 1024, "soft": 1024}],
        },
        "root": {"path": "rootfs", "readonly": True},
        "hostname": hostname,
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc",
             "options": ["nosuid", "noexec", "nodev"]},
            {"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
             "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
            {"destination": "/dev/pts", "type": "devpts", "source": "devpts",
             "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"]},
            {"destination": "/dev/shm", "type": "tmpfs", "source": "shm",
             "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"]},
            {"destination": "/sys", "type": "sysfs", "source": "sysfs",
             "options": ["nosuid", "noexec", "nodev", "ro"]},
            {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs",
             "options": ["nosuid", "nodev", "mode=1777", "size=65536k"]},
            {"destination": "/run", "type": "tmpfs", "source": "tmpfs",
             "options": ["nosuid", "nodev", "mode=755", "size=1024k"]},
            *system,
            *mounts,
        ],
        "linux": {
            "namespaces": [{"type": t} for t in ("pid", "mount", "ipc", "uts", "network")],
            "devices": devices,
            "resources": {"devices": rules},
            "maskedPaths": ["/proc/kcore", "/proc/keys", "/proc/timer_list", "/sys/firmware"],
            "readonlyPaths": ["/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys",
                              "/proc/sysrq-trigger"],
        },
    }


def rootfs_layout(rootfs: Rootfs, destinations: Sequence[str]
                  ) -> tuple[list[str], list[tuple[str, str]]]:
    """The host paths bound read-only into the rootfs, and its symlinks (path, target).

    A host directory that holds the destination of another mount (the response's
    /etc/ld.so.preload, say) is not bound whole: the mount point would have to be created in
    the host's own, read-only, directory. Its entries are bound one by one instead, as an
    image's own /etc would hold them, and the destination's mount point is made in the rootfs.
    """
    binds: list[str] = []
    links: list[tuple[str, str]] = []

    def place(path: str) -> None:
        if os.path.islink(path):
            links.append((path, os.readlink(path)))
        elif not any(d.startswith(path + "/") for d in destinations):
            if path not in destinations:
                binds.append(path)
        elif os.path.isdir(path):
            for child in sorted(os.listdir(path)):
                place(f"{path}/{child}")

    for name in rootfs.entries():
        place(f"/{name}")
    return binds, links


def write_bundle(bundle: Path, spec: Mapping[str, Any], rootfs: Rootfs) -> Path:
    """The bundle directory: config.json and a rootfs of mount points and the host's symlinks
    (e.g. /lib -> usr/lib on a merged-/usr system)."""
    root = bundle / "rootfs"
    root.mkdir(parents=True, exist_ok=True)
    destinations = [m["destination"] for m in spec["mounts"]]
    destinations += [d["path"] for d in spec["linux"]["devices"]]
    for path, target in rootfs_layout(rootfs, destinations)[1]:
        inside = root / path.lstrip("/")
        inside.parent.mkdir(parents=True, exist_ok=True)
        if not os.path.lexists(inside):
            os.symlink(target, inside)
    (bundle / "config.json").write_text(json.dumps(spec, indent=1))
    return bundle


# ---- runc ----

def runc_binary() -> str | None:
    given = os.environ.get(RUNC_ENV)
    if given:
        return given if os.access(given, os.X_OK) else None
    return shutil.which("runc") or next(
        (p for p in ("/usr/sbin/runc", "/usr/bin/runc") if os.access(p, os.X_OK)), None)


@functools.cache
def runc_refusal() -> str | None:
    """Why containers cannot run here (None when they can): a trivial container is tried."""
    runc = runc_binary()
    if runc is None:
        where = os.environ.get(RUNC_ENV)
        return (f"{RUNC_ENV}={where} is not an executable" if where else
                f"runc is not installed (apt-get install runc, or set {RUNC_ENV})")
    if os.geteuid() != 0:
        return "runc needs root here (rootless containers are not set up)"
    with tempfile.TemporaryDirectory(prefix="gm-runc-") as scratch:
        bundle = Path(scratch) / "b"
        config = ContainerConfig(args=("/bin/true",))
        nothing = types.SimpleNamespace(envs={}, mounts=(), devices=(), cdi_devices=())
        spec = oci_spec(nothing, config)
        write_bundle(bundle, spec, config.rootfs)
        state = Path(scratch) / "state"
        name = f"gm-probe-{uuid.uuid4().hex[:8]}"
        proc = subprocess.run([runc, "--root", str(state), "run", "--bundle", str(bundle), name],
                              stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=60)
        subprocess.run([runc, "--root", str(state), "delete", "--force", name],
                       capture_output=True, timeout=30)
    if proc.returncode != 0:
        return f"runc cannot run a container here: {proc.stderr.strip()[-500:]}"
    return None


class Container:
    """One run of a container under `runc run` (foreground: runc's exit status is the
    process's); the process's stdin is a pipe, its stdout lines are queued by a reader thread
    (a line is never left in a buffer that select cannot see), its stderr goes to a file."""

    def __init__(self, runtime: ContainerRuntime, name: str, bundle: Path) -> None:
        self.runtime, self.name, self.bundle = runtime, name, bundle
        self.stderr_path = bundle / "stderr"
        self._stderr: IO[str] = open(self.stderr_path, "w+")  # noqa: SIM115 - closed in delete()
        self.proc = subprocess.Popen(
            runtime.runc_argv("run", "--bundle", str(bundle), name),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr, text=True)
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read_lines, daemon=True).start()

    def _read_lines(self) -> None:
        assert self.proc.stdout is not None
        with contextlib.suppress(ValueError, OSError), self.proc.stdout:
            for line in self.proc.stdout:
                self._lines.put(line)
        self._lines.put("")   # end of output

    def state(self) -> dict[str, Any] | None:
        proc = subprocess.run(self.runtime.runc_argv("state", self.name), capture_output=True,
                              text=True, timeout=30)
        if proc.returncode != 0:
            return None
        state: dict[str, Any] = json.loads(proc.stdout)
        return state

    def pid(self, timeout: float = 30.0) -> int:
        """The container process's pid in the host's pid namespace (what SO_PEERCRED says)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = self.state()
            if state is not None and state.get("pid") and state.get("status") == "running":
                return int(state["pid"])
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise AssertionError(f"container {self.name} is not running:\n{self.errors()}")

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def read_json(self, timeout: float = 60.0) -> dict[str, Any]:
        """The next JSON line the process prints."""
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            line = ""
        if not line:
            self.kill()
            raise AssertionError(f"container {self.name} gave no line within {timeout} s "
                                 f"(exit {self.proc.returncode}):\n{self.errors()}")
        result: dict[str, Any] = json.loads(line)
        return result

    def step(self, line: str, timeout: float = 60.0) -> dict[str, Any]:
        self.send(line)
        return self.read_json(timeout)

    def errors(self) -> str:
        try:
            return self.stderr_path.read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def wait(self, timeout: float = 60.0) -> int:
        """Close stdin, wait for the process, delete the container; returns its exit status."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            with contextlib.suppress(BrokenPipeError):
                self.proc.stdin.close()
        try:
            code = self.proc.wait(timeout)
        finally:
            self.delete()
        return code

    def kill(self) -> None:
        if self.proc.poll() is None:
            subprocess.run(self.runtime.runc_argv("kill", self.name, "KILL"),
                           capture_output=True, timeout=30)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        self.delete()

    def delete(self) -> None:
        subprocess.run(self.runtime.runc_argv("delete", "--force", self.name),
                       capture_output=True, timeout=30)
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        self._stderr.close()


class ContainerRuntime:
    """runc with its own state directory under `root`; bundles are written there too."""

    def __init__(self, root: Path, cdi_dir: Path | None = None) -> None:
        runc = runc_binary()
        if runc is None:
            raise RuntimeError(runc_refusal() or "runc not found")
        self.runc = runc
        self.root = root
        self.cdi_dir = cdi_dir
        self.state_dir = root / "runc"
        self.containers: list[Container] = []

    def runc_argv(self, *args: str) -> list[str]:
        return [self.runc, "--root", str(self.state_dir), *args]

    def run(self, response: Any, config: ContainerConfig, name: str = "c") -> Container:
        """Start a container for `response` (a ContainerAllocateResponse) and `config`."""
        name = f"{name}-{uuid.uuid4().hex[:6]}"
        spec = oci_spec(response, config, self.cdi_dir, hostname=name[:63])
        bundle = write_bundle(self.root / "bundles" / name, spec, config.rootfs)
        container = Container(self, name, bundle)
        self.containers.append(container)
        return container

    def close(self) -> None:
        for container in self.containers:
            container.kill()
        self.containers.clear()

    def __enter__(self) -> ContainerRuntime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
