"""The runtime stage: Allocate responses turned into OCI specs (checked as data), and run by runc
(checked from inside the container). The runc tests skip, with the reason, where runc cannot run."""

from __future__ import annotations

import json
import os
import stat
import textwrap
from pathlib import Path
from typing import Any

import pytest

from vgpu_runtime.devkit.kubelet_emulator.runtime import (
    ContainerConfig,
    ContainerRuntime,
    SpecError,
    Volume,
    oci_spec,
    runc_refusal,
)
from vgpu_runtime.kubeletapi.deviceplugin.v1beta1 import api_pb2

REPO = Path(__file__).resolve().parents[2]
CONFIG = ContainerConfig(args=("true",))


def response(mounts: tuple[tuple[str, str, bool], ...] = (), envs: dict[str, str] | None = None,
             devices: tuple[tuple[str, str, str], ...] = (), cdi: tuple[str, ...] = ()) -> Any:
    return api_pb2.ContainerAllocateResponse(
        envs=envs or {},
        mounts=[api_pb2.Mount(container_path=c, host_path=h, read_only=ro)
                for c, h, ro in mounts],
        devices=[api_pb2.DeviceSpec(container_path=c, host_path=h, permissions=p)
                 for c, h, p in devices],
        cdi_devices=[api_pb2.CDIDevice(name=n) for n in cdi])


def write_cdi(directory: Path, spec: dict[str, Any], name: str = "gpu.json") -> Path:
    directory.mkdir(exist_ok=True)
    (directory / name).write_text(json.dumps(spec))
    return directory


GPU_SPEC = {
    "cdiVersion": "0.6.0", "kind": "example.com/gpu",
    "containerEdits": {"env": ["SHARED=1"],
                       "mounts": [{"hostPath": "/h/lib.so", "containerPath": "/drv/lib.so",
                                   "options": ["ro", "bind"]}]},
    "devices": [{"name": "GPU-a", "containerEdits": {
        "env": ["WHICH=a"],
        "deviceNodes": [{"path": "/dev/gpu-a", "type": "c", "major": 241, "minor": 7,
                         "permissions": "rw"}]}},
                {"name": "GPU-b", "containerEdits": {"env": ["WHICH=b"]}}],
}


def mount_at(spec: dict[str, Any], destination: str) -> dict[str, Any]:
    (found,) = [m for m in spec["mounts"] if m["destination"] == destination]
    return found


def env_of(spec: dict[str, Any]) -> dict[str, str]:
    return dict(entry.split("=", 1) for entry in spec["process"]["env"])


# ---- the spec, as data ----

def test_mounts_env_and_devices_are_applied_as_containerd_does() -> None:
    reply = response(mounts=(("/opt/lib", "/host/lib", True), ("/run/x", "/host/x", False)),
                     envs={"A": "1", "LD_PRELOAD": "/opt/lib/x.so"},
                     devices=(("/dev/gpu", "/dev/null", "r"),))
    config = ContainerConfig(args=("prog", "arg"), env={"A": "pod", "B": "2"},
                             volumes=(Volume("/host/out", "/out"),))
    spec = oci_spec(reply, config)
    assert mount_at(spec, "/opt/lib") == {"destination": "/opt/lib", "type": "bind",
                                          "source": "/host/lib",
                                          "options": ["rbind", "rprivate", "nosuid", "nodev",
                                                      "ro"]}
    assert "ro" not in mount_at(spec, "/run/x")["options"]
    assert "ro" not in mount_at(spec, "/out")["options"]
    # The pod's env comes after the plugin's and wins.
    assert env_of(spec)["A"] == "pod" and env_of(spec)["B"] == "2"
    assert env_of(spec)["LD_PRELOAD"] == "/opt/lib/x.so"
    null = os.stat("/dev/null").st_rdev
    assert spec["linux"]["devices"] == [{"path": "/dev/gpu", "type": "c",
                                         "major": os.major(null), "minor": os.minor(null),
                                         "fileMode": 0o666, "uid": 0, "gid": 0}]
    assert spec["linux"]["resources"]["devices"] == [
        {"allow": False, "access": "rwm"},
        {"allow": True, "type": "c", "major": os.major(null), "minor": os.minor(null),
         "access": "r"}]
    process = spec["process"]
    assert process["args"] == ["prog", "arg"] and process["user"]["uid"] != 0
    assert process["capabilities"]["effective"] == [] and process["noNewPrivileges"]
    assert {n["type"] for n in spec["linux"]["namespaces"]} >= {"pid", "mount", "ipc", "uts"}
    assert spec["root"] == {"path": "rootfs", "readonly": True}


def test_the_rootfs_holds_system_directories_read_only_and_never_the_project() -> None:
    spec = oci_spec(response(), CONFIG)
    sources = {m["source"]: m for m in spec["mounts"] if m["type"] == "bind"}
    assert "/usr" in sources and "ro" in sources["/usr"]["options"]
    for source in sources:
        assert not str(REPO).startswith(source.rstrip("/") + "/") and source != str(REPO)


def test_cdi_names_bring_the_kind_edits_once_then_each_device_edits(tmp_path: Path) -> None:
    cdi = write_cdi(tmp_path / "cdi", GPU_SPEC)
    spec = oci_spec(response(cdi=("example.com/gpu=GPU-a", "example.com/gpu=GPU-b")), CONFIG,
                    cdi)
    assert env_of(spec)["SHARED"] == "1" and env_of(spec)["WHICH"] == "b"
    assert mount_at(spec, "/drv/lib.so")["source"] == "/h/lib.so"
    assert "ro" in mount_at(spec, "/drv/lib.so")["options"]
    assert [d["path"] for d in spec["linux"]["devices"]] == ["/dev/gpu-a"]
    assert spec["linux"]["resources"]["devices"][1] == {
        "allow": True, "type": "c", "major": 241, "minor": 7, "access": "rw"}


@pytest.mark.parametrize(("bad", "message"), [
    (response(cdi=("example.com/gpu=GPU-z",)), "kind example.com/gpu has no device 'GPU-z'"),
    (response(cdi=("other.com/gpu=GPU-a",)), "no CDI spec of kind other.com/gpu"),
    (response(cdi=("GPU-a",)), "is not <vendor>/<class>=<device>"),
    (response(mounts=(("opt/lib", "/host", True),)), "'opt/lib' must be an absolute path"),
    (response(mounts=(("/opt/lib", "host", True),)), "'host' must be an absolute path"),
    (response(mounts=(("/", "/host", True),)), "refusing to mount over /"),
    (response(mounts=(("/a", "/h1", True), ("/a/", "/h2", True))), "/a is given twice"),
    (response(mounts=(("/a", "/h1", True),), devices=(("/a", "/dev/null", "rw"),)),
     "/a is given twice"),
    (response(devices=(("/dev/x", "/dev/null", "rwx"),)), "not a subset of 'rwm'"),
    (response(devices=(("/dev/x", "/etc/hostname", "rw"),)), "is not a device node"),
    (response(devices=(("/dev/x", "/nonexistent/node", "rw"),)), "host node /nonexistent"),
    (response(envs={"A=B": "x"}), "'A=B' is not valid"),
])
def test_what_cannot_be_applied_is_refused_with_the_reason(tmp_path: Path, bad: Any,
                                                            message: str) -> None:
    cdi = write_cdi(tmp_path / "cdi", GPU_SPEC)
    with pytest.raises(SpecError) as err:
        oci_spec(bad, CONFIG, cdi)
    assert message in str(err.value)


def test_cdi_hooks_a_root_process_and_an_empty_command_are_refused(tmp_path: Path) -> None:
    hooked = {**GPU_SPEC, "containerEdits": {"hooks": [{"hookName": "createContainer",
                                                        "path": "/bin/ldconfig"}]}}
    cdi = write_cdi(tmp_path / "cdi", hooked)
    with pytest.raises(SpecError, match=r"\['hooks'\] are not supported"):
        oci_spec(response(cdi=("example.com/gpu=GPU-b",)), CONFIG, cdi)
    with pytest.raises(SpecError, match="non-root uid"):
        oci_spec(response(), ContainerConfig(args=("true",), uid=0))
    with pytest.raises(SpecError, match="no command"):
        oci_spec(response(), ContainerConfig(args=()))


# ---- the container, from inside ----

INSIDE = textwrap.dedent("""
    import errno, json, os, socket
    def attempt(path, flags):
        try:
            os.close(os.open(path, flags))
            return "ok"
        except OSError as err:
            return errno.errorcode[err.errno]
    gpu = os.stat("/dev/gpu-a")
    print(json.dumps({
        "uid": os.getuid(), "pid": os.getpid(), "hostname": socket.gethostname(),
        "env": {k: os.environ.get(k) for k in ("A", "SHARED", "WHICH")},
        "lib": sorted(os.listdir("/opt/lib")),
        "lib_write": attempt("/opt/lib/new", os.O_WRONLY | os.O_CREAT),
        "out_write": attempt("/out/new", os.O_WRONLY | os.O_CREAT),
        "usr_write": attempt("/usr/new", os.O_WRONLY | os.O_CREAT),
        "gpu": [os.major(gpu.st_rdev), os.minor(gpu.st_rdev)],
        "gpu_write": attempt("/dev/gpu-a", os.O_WRONLY),
        "readonly_node_read": attempt("/dev/ro", os.O_RDONLY),
        "readonly_node_write": attempt("/dev/ro", os.O_WRONLY),
        "project": os.path.exists(REPO),
    }))
""")


def test_a_container_gets_what_the_response_gives_and_nothing_of_the_host(
        tmp_path: Path) -> None:
    reason = runc_refusal()
    if reason:
        pytest.skip(reason)
    lib, out = tmp_path / "lib", tmp_path / "out"
    lib.mkdir()
    (lib / "x.so").write_text("x")
    out.mkdir()
    out.chmod(0o777)
    # A device node the container may only read: a char device no driver serves here.
    node = tmp_path / "ro-node"
    os.mknod(node, stat.S_IFCHR | 0o666, os.makedev(241, 9))
    cdi = write_cdi(tmp_path / "cdi", GPU_SPEC)
    reply = response(mounts=(("/opt/lib", str(lib), True),), envs={"A": "1"},
                     devices=(("/dev/ro", str(node), "r"),), cdi=("example.com/gpu=GPU-a",))
    # The CDI spec's library mount points at a host file this test has.
    spec_file = cdi / "gpu.json"
    spec_file.write_text(spec_file.read_text().replace("/h/lib.so", str(lib / "x.so")))
    code = INSIDE.replace("REPO", repr(str(REPO)))
    config = ContainerConfig(args=("python3", "-c", code), volumes=(Volume(str(out), "/out"),))
    with ContainerRuntime(tmp_path / "rt", cdi) as runtime:
        container = runtime.run(reply, config, name="inspect")
        seen = container.read_json()
        assert container.wait() == 0, container.errors()
    assert seen["uid"] == 1000 and seen["pid"] == 1 and seen["hostname"].startswith("inspect")
    assert seen["env"] == {"A": "1", "SHARED": "1", "WHICH": "a"}
    assert seen["lib"] == ["x.so"] and seen["lib_write"] == "EROFS"
    assert seen["out_write"] == "ok" and (out / "new").exists()
    assert seen["usr_write"] in ("EROFS", "EACCES")
    assert seen["gpu"] == [241, 7] and seen["gpu_write"] != "EPERM"   # rw: allowed (no driver)
    # "r" in the DeviceSpec: the device cgroup refuses writing (EPERM), not reading.
    assert seen["readonly_node_write"] == "EPERM"
    assert seen["readonly_node_read"] != "EPERM"
    assert seen["project"] is False
    assert not (lib / "new").exists()


def test_a_container_that_fails_to_start_says_why(tmp_path: Path) -> None:
    reason = runc_refusal()
    if reason:
        pytest.skip(reason)
    reply = response(mounts=(("/opt/lib", str(tmp_path / "missing"), True),))
    with ContainerRuntime(tmp_path / "rt") as runtime:
        container = runtime.run(reply, ContainerConfig(args=("true",)), name="broken")
        assert container.wait() != 0
        assert "missing" in container.errors()


def test_a_mount_inside_a_host_system_directory_leaves_the_rest_of_it_and_the_host_alone(
        tmp_path: Path) -> None:
    """/etc/ld.so.preload (`--injection preload-file`): /etc is then bound entry by entry, so
    the mount point is made in the container's rootfs, never in the host's /etc."""
    reason = runc_refusal()
    if reason:
        pytest.skip(reason)
    preload = tmp_path / "ld.so.preload"
    preload.write_text("/opt/lib/x.so\n")
    host_file = Path("/etc/ld.so.preload")
    before = host_file.read_bytes() if host_file.exists() else None
    reply = response(mounts=((str(host_file), str(preload), True),))
    code = ("import json, os; print(json.dumps({'preload': open('/etc/ld.so.preload').read(), "
            "'passwd': os.path.exists('/etc/passwd'), 'uid': os.getuid()}))")
    with ContainerRuntime(tmp_path / "rt") as runtime:
        container = runtime.run(reply, ContainerConfig(args=("python3", "-c", code)))
        seen = container.read_json()
        assert container.wait() == 0, container.errors()
    assert seen == {"preload": "/opt/lib/x.so\n", "passwd": True, "uid": 1000}
    assert (host_file.read_bytes() if host_file.exists() else None) == before
