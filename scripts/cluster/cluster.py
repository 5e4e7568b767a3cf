#!/usr/bin/env python3
"""A real single-node Kubernetes cluster on this host, for the tests marked `cluster`.

Usage: scripts/cluster/cluster.py up|down|status|env|build [--state DIR]
       scripts/cluster/cluster.py restart COMPONENT   (etcd, kube-apiserver, ..., kubelet)

  build   builds what is missing into the cache (GEMINI_CLUSTER_CACHE, default
          /root/.cache/gemini-cluster): Kubernetes 1.34 (kube-apiserver, kube-controller-manager,
          kube-scheduler, kubelet, kube-proxy, kubectl), etcd, containerd + ctr + the runc shim,
          the CNI plugins, Helm 4 (helm, for the chart in daemonset/chart/), each from the Go
          module beside this file, the pause image, and the Prometheus Operator's
          ServiceMonitor CRD (copied from its Go module, monitoring/, for the chart's
          ServiceMonitor: `env` names the file; nothing applies it but the test that needs it). A
          cache directory's name carries its module's version and a hash of go.mod/go.sum, so
          binaries are reused exactly while the module is unchanged.
  up      build, then certificates and kubeconfigs (RBAC on), etcd, the API server, the
          controller manager, the scheduler, containerd (CDI on, runc), the kubelet and
          kube-proxy as host processes, a CNI bridge config; waits for the node to be Ready.
          Prints `export KUBECONFIG=...`. State lives in GEMINI_CLUSTER_STATE (default
          /tmp/gemini-cluster) except what kubelet fixes: /var/lib/kubelet (its device-plugin
          directory is a constant of kubelet, not of --root-dir).
  down    stops every process `up` started (pods' containers first), unmounts what kubelet and
          containerd mounted, removes kube-proxy's and CNI's iptables rules and the bridge,
          restores the sysctls kubelet changes, removes the state, /var/lib/kubelet and the
          /var/lib/gemini the DaemonSet wrote.
  status  each process and `kubectl get nodes`.
  env     JSON: kubeconfig, binaries, containerd socket (what the tests read).

Root only (cgroups, mounts, iptables). Needs runc, iptables, openssl and gcc (Debian packages),
Go for the build.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

HERE = Path(__file__).resolve().parent
CACHE = Path(os.environ.get("GEMINI_CLUSTER_CACHE", "/root/.cache/gemini-cluster"))
DEFAULT_STATE = Path(os.environ.get("GEMINI_CLUSTER_STATE", "/tmp/gemini-cluster"))
# kubelet's device-plugin directory is the constant /var/lib/kubelet/device-plugins whatever
# --root-dir says, and the DaemonSet mounts these host paths: so the real ones.
KUBELET_ROOT = Path("/var/lib/kubelet")
GEMINI_STATE = Path("/var/lib/gemini")

NODE_NAME = "gemini-test-node"
SERVICE_CIDR = "10.96.0.0/16"
SERVICE_IP = "10.96.0.1"
POD_SUBNET = "10.244.0.0/24"
BRIDGE = "gemini-cni0"
ETCD_CLIENT_PORT = 23790
ETCD_PEER_PORT = 23800
API_PORT = 6443
PAUSE_IMAGE = "registry.k8s.io/pause:3.10"
# The tests' workloads: Debian's static busybox, its applets as links (a shell, cat, env).
WORKLOAD_IMAGE = "localhost/gemini-test-workload:1"
BUSYBOX = Path("/bin/busybox")
BUSYBOX_APPLETS = ("sh", "cat", "env", "ls", "sleep", "grep", "test", "stat", "readlink")

K8S_BINARIES = ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubelet",
                "kube-proxy", "kubectl")
# The Prometheus Operator's module, for its ServiceMonitor CustomResourceDefinition.
MONITORING_MODULE = "github.com/prometheus-operator/prometheus-operator"
SERVICEMONITOR_CRD = "example/prometheus-operator-crd/monitoring.coreos.com_servicemonitors.yaml"
CNI_PLUGINS = {"bridge": "plugins/main/bridge", "host-local": "plugins/ipam/host-local",
               "loopback": "plugins/main/loopback", "portmap": "plugins/meta/portmap"}
# Start order; `down` stops them in reverse.
COMPONENTS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler",
              "containerd", "kubelet", "kube-proxy")
# Sysctls kubelet (and the CNI bridge) change on the host; `down` puts the old values back.
SYSCTLS = ("vm.overcommit_memory", "kernel.panic", "kernel.panic_on_oops",
           "net.ipv4.ip_forward", "net.bridge.bridge-nf-call-iptables",
           "net.ipv4.conf.all.route_localnet")


class ClusterError(RuntimeError):
    pass


def say(message: str) -> None:
    print(f"cluster: {message}", flush=True)


def run(command: Sequence[str | Path], *, env: dict[str, str] | None = None,
        cwd: Path | None = None, check: bool = True, quiet: bool = False) -> str:
    result = subprocess.run([str(c) for c in command], capture_output=True, text=True,
                            env=env, cwd=cwd, stdin=subprocess.DEVNULL)
    if check and result.returncode != 0:
        raise ClusterError(f"{' '.join(str(c) for c in command)} failed ({result.returncode}):\n"
                           f"{result.stdout[-4000:]}{result.stderr[-4000:]}")
    if not quiet and result.returncode != 0:
        say(f"(ignored) {' '.join(str(c) for c in command)}: {result.stderr.strip()[-300:]}")
    return result.stdout


# ---------------------------------------------------------------------------------------------
# Building


def module_require(module_dir: Path, module: str) -> str:
    """The version a module of ours requires of `module` (its go.mod's require line)."""
    text = (module_dir / "go.mod").read_text()
    match = re.search(rf"^\s*(?:require\s+)?{re.escape(module)}\s+(v\S+)", text, re.M)
    if match is None:
        raise ClusterError(f"{module_dir}/go.mod requires no {module}")
    return match.group(1)


def build_dir(name: str, module_dir: Path, module: str) -> Path:
    """Cache directory of one module's binaries: version and go.mod/go.sum hash in its name."""
    # Comments aside: a reworded comment in go.mod must not rebuild Kubernetes.
    digest = hashlib.sha256()
    for file in ("go.mod", "go.sum"):
        lines = (module_dir / file).read_text().splitlines()
        digest.update("\n".join(ln for ln in lines if not ln.startswith("//")).encode())
    return CACHE / f"{name}-{module_require(module_dir, module)}-{digest.hexdigest()[:10]}"


def go_build(module_dir: Path, out: Path, targets: Sequence[tuple[str, str]],
             ldflags: str = "", tags: str = "") -> None:
    """Builds each (package, binary name) of a module of ours into out/, niced, cache outside
    the tree; into a temporary directory renamed at the end, so a half build is never reused."""
    if all((out / name).is_file() for _, name in targets):
        return
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    env = dict(os.environ, GOCACHE=str(CACHE / "go-build"), CGO_ENABLED="0",
               GOFLAGS="-buildvcs=false -mod=readonly")
    # Other work shares this machine's cores: niced, at most GEMINI_CLUSTER_BUILD_JOBS (2).
    jobs = os.environ.get("GEMINI_CLUSTER_BUILD_JOBS", "2")
    start = time.monotonic()
    say(f"building {module_dir.name} into {out} (cold: minutes; see {CACHE}/logs)")
    for package, name in targets:
        command = ["nice", "-n", "15", "go", "build", "-p", jobs, "-trimpath",
                   "-ldflags", f"-s -w {ldflags}".strip(), "-o", str(tmp / name)]
        if tags:
            command += ["-tags", tags]
        run([*command, package], env=env, cwd=module_dir)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    say(f"built {module_dir.name} in {time.monotonic() - start:.0f} s")


def k8s_bin() -> Path:
    return build_dir("k8s", HERE / "k8s", "k8s.io/kubernetes") / "bin"


def etcd_bin() -> Path:
    return build_dir("etcd", HERE / "etcd", "go.etcd.io/etcd/server/v3") / "bin"


def containerd_bin() -> Path:
    module = "github.com/containerd/containerd/v2"
    return build_dir("containerd", HERE / "containerd", module) / "bin"


def cni_bin() -> Path:
    return build_dir("cni", HERE / "cni", "github.com/containernetworking/plugins") / "bin"


def helm_bin() -> Path:
    return build_dir("helm", HERE / "helm", "helm.sh/helm/v4") / "bin"


def monitoring_dir() -> Path:
    return build_dir("monitoring", HERE / "monitoring", MONITORING_MODULE)


def servicemonitor_crd() -> Path:
    return monitoring_dir() / "servicemonitors.crd.yaml"


def copy_servicemonitor_crd() -> None:
    """The ServiceMonitor CRD out of the Prometheus Operator's module (the Go module proxy,
    checked against monitoring/go.sum) into the cache; a module's file, not a built binary."""
    if servicemonitor_crd().is_file():
        return
    env = dict(os.environ, GOFLAGS="-mod=readonly")
    module = json.loads(run(["go", "mod", "download", "-json", MONITORING_MODULE], env=env,
                            cwd=HERE / "monitoring"))
    source = Path(module["Dir"]) / SERVICEMONITOR_CRD
    if not source.is_file():
        raise ClusterError(f"{MONITORING_MODULE}@{module['Version']} has no {SERVICEMONITOR_CRD}")
    out = monitoring_dir()
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    shutil.copyfile(source, tmp / servicemonitor_crd().name)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    say(f"ServiceMonitor CRD of {MONITORING_MODULE}@{module['Version']} -> {servicemonitor_crd()}")


def pause_archive() -> Path:
    digest = hashlib.sha256((HERE / "images" / "pause.c").read_bytes()).hexdigest()[:10]
    return CACHE / f"pause-{digest}.oci.tar"


def build_all() -> None:
    version = module_require(HERE / "k8s", "k8s.io/kubernetes")
    minor = version.split(".")[1]
    # What kubelet reports as the node's version, and kubectl version: the release built.
    ldflags = " ".join(f"-X {var}={value}" for var, value in (
        ("k8s.io/component-base/version.gitVersion", version),
        ("k8s.io/component-base/version.gitMajor", "1"),
        ("k8s.io/component-base/version.gitMinor", minor),
        ("k8s.io/component-base/version.gitTreeState", "clean"),
        ("k8s.io/client-go/pkg/version.gitVersion", version)))
    go_build(HERE / "k8s", k8s_bin(),
             [(f"k8s.io/kubernetes/cmd/{name}", name) for name in K8S_BINARIES], ldflags)
    go_build(HERE / "etcd", etcd_bin(), [("go.etcd.io/etcd/server/v3", "etcd")])
    # btrfs and devmapper snapshotters need cgo and headers; overlayfs is what runs here.
    go_build(HERE / "containerd", containerd_bin(),
             [(f"github.com/containerd/containerd/v2/cmd/{name}", name)
              for name in ("containerd", "containerd-shim-runc-v2", "ctr")],
             tags="no_btrfs no_devmapper no_zfs")
    go_build(HERE / "cni", cni_bin(),
             [(f"github.com/containernetworking/plugins/{path}", name)
              for name, path in CNI_PLUGINS.items()])
    # `helm version` names the release built, as the project's own release build does.
    helm_version = module_require(HERE / "helm", "helm.sh/helm/v4")
    go_build(HERE / "helm", helm_bin(), [("helm.sh/helm/v4/cmd/helm", "helm")],
             f"-X helm.sh/helm/v4/internal/version.version={helm_version} "
             "-X helm.sh/helm/v4/internal/version.gitTreeState=clean")
    copy_servicemonitor_crd()
    if not pause_archive().is_file():
        build_pause(pause_archive())
    if not workload_archive().is_file():
        build_workload(workload_archive())
    prune_cache()


def prune_cache() -> None:
    """Once everything is built, the cache keeps the binaries alone: Go's build cache (3.7 GB
    after a cold build), and entries of a built family (k8s-, pause-, ...) that are not the
    current one (other versions, half builds), go, so that a host that keeps the cache between
    runs (a CI machine) holds one build's worth, not every build's. Anything else stays."""
    current = {path.name for path in (k8s_bin().parent, etcd_bin().parent,
                                      containerd_bin().parent, cni_bin().parent,
                                      helm_bin().parent, monitoring_dir(), pause_archive(),
                                      workload_archive())}
    families = {name.split("-", 1)[0] for name in current}
    for entry in CACHE.iterdir():
        name = entry.name
        if name != "go-build" and (name in current or name.split("-", 1)[0] not in families):
            continue
        say(f"pruning {entry} (the cache keeps the current binaries)")
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------------
# Images without a registry


def _tar_bytes(entries: Iterable[tuple[str, bytes | str, int]]) -> bytes:
    """A reproducible tar of (path, content, mode) entries: bytes are a file, a str a symlink
    to that target."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path, content, mode in entries:
            info = tarfile.TarInfo(path)
            info.mode, info.mtime = mode, 0
            if isinstance(content, str):
                info.type, info.linkname = tarfile.SYMTYPE, content
                tar.addfile(info)
            else:
                info.size = len(content)
                tar.addfile(info, io.BytesIO(content))
    return buffer.getvalue()


def oci_archive(out: Path, ref: str, files: Iterable[tuple[str, bytes | str, int]],
                entrypoint: Sequence[str]) -> None:
    """Writes an OCI image layout archive of one uncompressed layer (what `ctr images import`
    takes), named `ref` by the index's org.opencontainers.image.ref.name and containerd's
    io.containerd.image.name annotations."""
    layer = _tar_bytes(files)
    layer_digest = "sha256:" + hashlib.sha256(layer).hexdigest()
    config = json.dumps({
        "architecture": "amd64", "os": "linux",
        "config": {"Entrypoint": list(entrypoint), "Env": ["PATH=/usr/bin:/bin"]},
        "rootfs": {"type": "layers", "diff_ids": [layer_digest]},
    }, sort_keys=True).encode()
    config_digest = "sha256:" + hashlib.sha256(config).hexdigest()
    manifest = json.dumps({
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                   "digest": config_digest, "size": len(config)},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar",
                    "digest": layer_digest, "size": len(layer)}],
    }, sort_keys=True).encode()
    manifest_digest = "sha256:" + hashlib.sha256(manifest).hexdigest()
    index = json.dumps({
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [{"mediaType": "application/vnd.oci.image.manifest.v1+json",
                       "digest": manifest_digest, "size": len(manifest),
                       "annotations": {
                           "io.containerd.image.name": ref,
                           "org.opencontainers.image.ref.name": ref.rsplit(":", 1)[1]}}],
    }, sort_keys=True).encode()
    blobs: list[tuple[str, bytes | str, int]] = [(f"blobs/sha256/{d.split(':')[1]}", b, 0o644)
             for d, b in ((layer_digest, layer), (config_digest, config),
                          (manifest_digest, manifest))]
    data = _tar_bytes([("oci-layout", b'{"imageLayoutVersion":"1.0.0"}', 0o644),
                       ("index.json", index, 0o644), *blobs])
    tmp = out.with_name(out.name + ".partial")
    tmp.write_bytes(data)
    tmp.rename(out)


def build_pause(out: Path) -> None:
    """The sandbox image: images/pause.c built statically, alone in one layer."""
    out.parent.mkdir(parents=True, exist_ok=True)
    binary = out.with_name("pause.bin")
    run(["gcc", "-O2", "-static", "-Wall", "-Wextra", "-o", binary, HERE / "images" / "pause.c"])
    run(["strip", binary])
    oci_archive(out, PAUSE_IMAGE, [("pause", binary.read_bytes(), 0o755)], ["/pause"])
    binary.unlink()
    say(f"pause image {PAUSE_IMAGE} -> {out}")


def workload_archive() -> Path:
    digest = hashlib.sha256(BUSYBOX.read_bytes()).hexdigest()[:10]
    return CACHE / f"workload-{digest}.oci.tar"


def build_workload(out: Path) -> None:
    """The tests' workload image: a static busybox and links to the applets they use."""
    if "statically linked" not in run(["file", "-L", BUSYBOX]):
        raise ClusterError(f"{BUSYBOX} is not static: apt-get install busybox-static")
    files: list[tuple[str, bytes | str, int]] = [("bin/busybox", BUSYBOX.read_bytes(), 0o755)]
    files += [(f"bin/{applet}", "busybox", 0o777) for applet in BUSYBOX_APPLETS]
    oci_archive(out, WORKLOAD_IMAGE, files, ["/bin/sh"])
    say(f"workload image {WORKLOAD_IMAGE} -> {out}")


# ---------------------------------------------------------------------------------------------
# Certificates and kubeconfigs


def host_ip() -> str:
    """The address of the interface of the default route: the node's and the API's address
    (the `kubernetes` Service's endpoint may not be a loopback address)."""
    route = run(["ip", "-4", "route", "get", "192.0.2.123"])
    match = re.search(r"\bsrc (\S+)", route)
    if match is None:
        raise ClusterError(f"no source address in `ip route get`: {route!r}")
    return match.group(1)


def make_pki(state: Path, ip: str) -> None:
    pki = state / "pki"
    pki.mkdir(parents=True, exist_ok=True)
    ca_key, ca_crt = pki / "ca.key", pki / "ca.crt"
    run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", ca_key,
         "-out", ca_crt, "-days", "30", "-subj", "/CN=gemini-test-cluster-ca"])
    # Service account tokens: the API server signs with the key, verifies with the public half.
    run(["openssl", "genrsa", "-out", pki / "sa.key", "2048"])
    run(["openssl", "rsa", "-in", pki / "sa.key", "-pubout", "-out", pki / "sa.pub"])
    certs: dict[str, tuple[str, str]] = {
        # name: (subject, subjectAltName or "")
        "apiserver": ("/CN=kube-apiserver",
                      f"DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,"
                      f"DNS:kubernetes.default.svc.cluster.local,DNS:localhost,"
                      f"IP:{SERVICE_IP},IP:{ip},IP:127.0.0.1"),
        "admin": ("/O=system:masters/CN=kubernetes-admin", ""),
        "apiserver-kubelet-client": ("/O=system:masters/CN=kube-apiserver-kubelet-client", ""),
        "controller-manager": ("/CN=system:kube-controller-manager", ""),
        "scheduler": ("/CN=system:kube-scheduler", ""),
        "kubelet": (f"/O=system:nodes/CN=system:node:{NODE_NAME}", ""),
        "kubelet-server": (f"/CN={NODE_NAME}", f"DNS:{NODE_NAME},IP:{ip},IP:127.0.0.1"),
        "kube-proxy": ("/CN=system:kube-proxy", ""),
    }
    for name, (subject, san) in certs.items():
        key, csr, crt = pki / f"{name}.key", pki / f"{name}.csr", pki / f"{name}.crt"
        run(["openssl", "req", "-new", "-newkey", "rsa:2048", "-nodes", "-keyout", key,
             "-out", csr, "-subj", subject])
        ext = pki / f"{name}.ext"
        usage = "serverAuth" if name in ("apiserver", "kubelet-server") else "clientAuth"
        ext.write_text(f"keyUsage=critical,digitalSignature,keyEncipherment\n"
                       f"extendedKeyUsage={usage}\nbasicConstraints=critical,CA:FALSE\n"
                       + (f"subjectAltName={san}\n" if san else ""))
        run(["openssl", "x509", "-req", "-in", csr, "-CA", ca_crt, "-CAkey", ca_key,
             "-CAcreateserial", "-out", crt, "-days", "30", "-extfile", ext])
    for name, user in (("admin", "admin"), ("controller-manager", "controller-manager"),
                       ("scheduler", "scheduler"), ("kubelet", "kubelet"),
                       ("kube-proxy", "kube-proxy")):
        kubeconfig(state / f"{name}.kubeconfig", ip, pki / f"{name}.crt", pki / f"{name}.key",
                   ca_crt, user)


def kubeconfig(path: Path, ip: str, crt: Path, key: Path, ca: Path, user: str) -> None:
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "gemini-test",
        "clusters": [{"name": "gemini-test", "cluster": {
            "server": f"https://{ip}:{API_PORT}", "certificate-authority": str(ca)}}],
        "users": [{"name": user, "user": {"client-certificate": str(crt),
                                          "client-key": str(key)}}],
        "contexts": [{"name": "gemini-test", "context": {"cluster": "gemini-test",
                                                         "user": user}}],
    }, indent=1))


# ---------------------------------------------------------------------------------------------
# Processes


def pid_file(state: Path, name: str) -> Path:
    return state / "pids" / f"{name}.pid"


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie of ours is not alive.
    with contextlib.suppress(OSError):
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] != "Z"
    return True


def component_pid(state: Path, name: str) -> int | None:
    with contextlib.suppress(OSError, ValueError):
        pid = int(pid_file(state, name).read_text())
        return pid if alive(pid) else None
    return None


def start(state: Path, name: str, command: Sequence[str | Path],
          env: dict[str, str] | None = None) -> int:
    """Starts a component in a session of its own, its output in logs/<name>.log."""
    (state / "logs").mkdir(parents=True, exist_ok=True)
    (state / "pids").mkdir(parents=True, exist_ok=True)
    log = (state / "logs" / f"{name}.log").open("ab")
    process = subprocess.Popen([str(c) for c in command], stdout=log, stderr=subprocess.STDOUT,
                               stdin=subprocess.DEVNULL, start_new_session=True,
                               env=env or dict(os.environ))
    log.close()
    pid_file(state, name).write_text(str(process.pid))
    # What `restart` needs to start it again the same way.
    (state / "pids" / f"{name}.json").write_text(json.dumps(
        {"command": [str(c) for c in command], "path": (env or os.environ).get("PATH", "")}))
    return process.pid


def restart(state: Path, name: str) -> None:
    """Stops one component (SIGTERM, as systemd would) and starts it again with the same
    command line; waits for the API server or kubelet to answer again."""
    saved = json.loads((state / "pids" / f"{name}.json").read_text())
    pid = component_pid(state, name)
    if pid:
        stop_pid(pid)
    start(state, name, saved["command"], env=dict(os.environ, PATH=saved["path"]))
    if name == "kubelet":
        wait_for("kubelet's healthz", lambda: run(
            ["curl", "-sf", "http://127.0.0.1:10248/healthz"], check=False, quiet=True) == "ok",
            60, state, "kubelet")
    elif name == "kube-apiserver":
        wait_for("the API server's /readyz",
                 lambda: kubectl(state, "get", "--raw", "/readyz").strip() == "ok",
                 180, state, "kube-apiserver")
    say(f"{name} restarted")


def wait_for(what: str, check: object, timeout: float, state: Path,
             component: str | None = None) -> None:
    assert callable(check)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            if check():
                return
        if component is not None and component_pid(state, component) is None:
            raise ClusterError(f"{component} exited while waiting for {what}; its log:\n"
                               + tail(state / "logs" / f"{component}.log"))
        time.sleep(0.5)
    raise ClusterError(f"timed out after {timeout:.0f} s waiting for {what}"
                       + (f"; {component}'s log:\n" + tail(state / "logs" / f"{component}.log")
                          if component else ""))


def tail(path: Path, lines: int = 40) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    return "(no log)"


def kubectl(state: Path, *args: str, check: bool = True) -> str:
    return run([started_bin(state, "k8s", k8s_bin()) / "kubectl", "--kubeconfig",
                state / "admin.kubeconfig", *args],
               check=check, quiet=True)


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((host, port)) == 0


# ---------------------------------------------------------------------------------------------
# Configuration files


def restrict_oom() -> bool:
    """Whether this process may not lower its oom_score_adj (no CAP_SYS_RESOURCE, bit 24)."""
    caps = re.search(r"^CapEff:\s*([0-9a-f]+)", Path("/proc/self/status").read_text(), re.M)
    return caps is None or not int(caps.group(1), 16) & (1 << 24)


def containerd_config(state: Path) -> Path:
    base = state / "containerd"
    shim_dir = containerd_bin()
    config = f"""version = 3
root = "{base}/root"
state = "{base}/state"

[grpc]
  address = "{base}/containerd.sock"

[plugins.'io.containerd.cri.v1.runtime']
  # This host withholds CAP_SYS_RESOURCE even from root, so no process may lower an
  # oom_score_adj (runc's init dies writing the sandbox's -998: "failed to update
  # /proc/self/oom_score_adj: Permission denied"). Clamp pods' values at containerd's own (0).
  restrict_oom_score_adj = {'true' if restrict_oom() else 'false'}
  enable_cdi = true
  cdi_spec_dirs = ["{state}/cdi"]
  [plugins.'io.containerd.cri.v1.runtime'.containerd]
    default_runtime_name = "runc"
    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
        BinaryName = "{shutil.which('runc') or '/usr/sbin/runc'}"
        SystemdCgroup = false
  [plugins.'io.containerd.cri.v1.runtime'.cni]
    bin_dirs = ["{cni_bin()}"]
    conf_dir = "{state}/cni/net.d"

[plugins.'io.containerd.cri.v1.images']
  snapshotter = "overlayfs"
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = "{PAUSE_IMAGE}"
"""
    path = base / "config.toml"
    base.mkdir(parents=True, exist_ok=True)
    path.write_text(config)
    (state / "cdi").mkdir(exist_ok=True)
    # The shim is found on PATH next to containerd.
    assert (shim_dir / "containerd-shim-runc-v2").is_file()
    return path


def cni_config(state: Path) -> None:
    net = state / "cni" / "net.d"
    net.mkdir(parents=True, exist_ok=True)
    (net / "10-gemini.conflist").write_text(json.dumps({
        "cniVersion": "1.0.0", "name": "gemini-test",
        "plugins": [
            {"type": "bridge", "bridge": BRIDGE, "isGateway": True, "ipMasq": True,
             "hairpinMode": True,
             "ipam": {"type": "host-local", "ranges": [[{"subnet": POD_SUBNET}]],
                      "routes": [{"dst": "0.0.0.0/0"}],
                      "dataDir": str(state / "cni" / "ipam")}},
            {"type": "portmap", "capabilities": {"portMappings": True}},
        ]}, indent=1))


def kubelet_config(state: Path, ip: str) -> Path:
    pki = state / "pki"
    config = {
        "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
        "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": True},
                           "x509": {"clientCAFile": str(pki / "ca.crt")}},
        "authorization": {"mode": "Webhook"},
        "tlsCertFile": str(pki / "kubelet-server.crt"),
        "tlsPrivateKeyFile": str(pki / "kubelet-server.key"),
        # No systemd here: cgroupfs, as containerd's runc (SystemdCgroup = false).
        "cgroupDriver": "cgroupfs",
        "containerRuntimeEndpoint": f"unix://{state}/containerd/containerd.sock",
        "failSwapOn": False,
        "resolvConf": "/etc/resolv.conf",
        "port": 10250, "readOnlyPort": 0, "healthzPort": 10248,
        # A shared development machine: evict only when it is really out of memory or disk.
        "evictionHard": {"memory.available": "100Mi", "nodefs.available": "1%",
                         "imagefs.available": "1%", "nodefs.inodesFree": "1%"},
        "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
        "serializeImagePulls": False,
        "podCIDR": POD_SUBNET,
        "clusterDomain": "cluster.local",
        "maxPods": 50,
        "nodeStatusReportFrequency": "10s",
        "volumePluginDir": str(state / "kubelet-plugins"),
    }
    path = state / "kubelet.yaml"
    path.write_text(json.dumps(config, indent=1))
    return path


def kube_proxy_config(state: Path, ip: str) -> Path:
    config = {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1", "kind": "KubeProxyConfiguration",
        "clientConnection": {"kubeconfig": str(state / "kube-proxy.kubeconfig")},
        "mode": "iptables", "clusterCIDR": POD_SUBNET, "hostnameOverride": NODE_NAME,
        "bindAddress": ip,
        # Leave the host's conntrack table sizes alone (0: do not set).
        "conntrack": {"maxPerCore": 0, "min": 0},
        "metricsBindAddress": "127.0.0.1:10249", "healthzBindAddress": "127.0.0.1:10256",
    }
    path = state / "kube-proxy.yaml"
    path.write_text(json.dumps(config, indent=1))
    return path


# ---------------------------------------------------------------------------------------------
# up / down / status


def read_sysctl(name: str) -> str | None:
    with contextlib.suppress(OSError):
        return Path("/proc/sys", *name.split(".")).read_text().strip()
    return None


def write_sysctl(name: str, value: str) -> None:
    with contextlib.suppress(OSError):
        Path("/proc/sys", *name.split(".")).write_text(value)


def up(state: Path) -> None:
    if os.geteuid() != 0:
        raise ClusterError("needs root: cgroups, mounts, iptables")
    for tool in ("runc", "iptables", "openssl", "gcc", "go", "ip", "file"):
        if shutil.which(tool) is None:
            raise ClusterError(f"{tool} is missing (apt-get install runc iptables openssl gcc "
                               "iproute2; Go from the machine)")
    running = [name for name in COMPONENTS if component_pid(state, name)]
    if running:
        raise ClusterError(f"already running in {state}: {', '.join(running)} (cluster.py down)")
    t0 = time.monotonic()
    build_all()
    t_build = time.monotonic() - t0
    if state.exists():
        down(state, quiet=True)
    state.mkdir(parents=True)
    if (KUBELET_ROOT / "pods").exists() and any((KUBELET_ROOT / "pods").iterdir()):
        raise ClusterError(f"{KUBELET_ROOT} holds pods of another kubelet; not touching it")
    (state / "created").write_text("\n".join(str(p) for p in (KUBELET_ROOT, GEMINI_STATE)
                                             if not p.exists()))
    t1 = time.monotonic()
    (state / "sysctls.json").write_text(json.dumps({n: read_sysctl(n) for n in SYSCTLS}))
    # Pods reach the API through the Service's ClusterIP (kube-proxy's DNAT): routed traffic.
    write_sysctl("net.ipv4.ip_forward", "1")
    write_sysctl("net.bridge.bridge-nf-call-iptables", "1")
    (state / "bin.json").write_text(json.dumps({"k8s": str(k8s_bin()),
                                                "containerd": str(containerd_bin()),
                                                "helm": str(helm_bin())}))
    ip = host_ip()
    make_pki(state, ip)
    pki = state / "pki"
    k8s, env = k8s_bin(), dict(os.environ)

    start(state, "etcd", [
        etcd_bin() / "etcd", "--name", "gemini-test", "--data-dir", state / "etcd",
        "--listen-client-urls", f"http://127.0.0.1:{ETCD_CLIENT_PORT}",
        "--advertise-client-urls", f"http://127.0.0.1:{ETCD_CLIENT_PORT}",
        "--listen-peer-urls", f"http://127.0.0.1:{ETCD_PEER_PORT}",
        "--initial-advertise-peer-urls", f"http://127.0.0.1:{ETCD_PEER_PORT}",
        "--initial-cluster", f"gemini-test=http://127.0.0.1:{ETCD_PEER_PORT}",
        "--listen-metrics-urls", "http://127.0.0.1:23810", "--log-level", "warn"])
    wait_for("etcd", lambda: port_open(ETCD_CLIENT_PORT), 60, state, "etcd")

    start(state, "kube-apiserver", [
        k8s / "kube-apiserver", f"--etcd-servers=http://127.0.0.1:{ETCD_CLIENT_PORT}",
        f"--advertise-address={ip}", "--bind-address=0.0.0.0", f"--secure-port={API_PORT}",
        f"--service-cluster-ip-range={SERVICE_CIDR}", "--authorization-mode=Node,RBAC",
        "--enable-admission-plugins=NodeRestriction", "--allow-privileged=true",
        f"--client-ca-file={pki / 'ca.crt'}", f"--tls-cert-file={pki / 'apiserver.crt'}",
        f"--tls-private-key-file={pki / 'apiserver.key'}",
        f"--kubelet-client-certificate={pki / 'apiserver-kubelet-client.crt'}",
        f"--kubelet-client-key={pki / 'apiserver-kubelet-client.key'}",
        f"--kubelet-certificate-authority={pki / 'ca.crt'}",
        "--kubelet-preferred-address-types=InternalIP",
        "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
        f"--service-account-key-file={pki / 'sa.pub'}",
        f"--service-account-signing-key-file={pki / 'sa.key'}",
        "--profiling=false", "--v=1"])
    wait_for("the API server's /readyz",
             lambda: kubectl(state, "get", "--raw", "/readyz").strip() == "ok",
             180, state, "kube-apiserver")

    for name, cfg in (("kube-controller-manager", "controller-manager"),
                      ("kube-scheduler", "scheduler")):
        kc = state / f"{cfg}.kubeconfig"
        extra = [f"--cluster-signing-cert-file={pki / 'ca.crt'}",
                 f"--cluster-signing-key-file={pki / 'ca.key'}",
                 f"--root-ca-file={pki / 'ca.crt'}",
                 f"--service-account-private-key-file={pki / 'sa.key'}",
                 "--use-service-account-credentials=true",
                 f"--service-cluster-ip-range={SERVICE_CIDR}"] if cfg == "controller-manager" \
            else []
        start(state, name, [k8s / name, f"--kubeconfig={kc}",
                            f"--authentication-kubeconfig={kc}",
                            f"--authorization-kubeconfig={kc}", "--leader-elect=false",
                            "--bind-address=127.0.0.1", *extra, "--v=1"])

    (state / "containerd").mkdir(parents=True, exist_ok=True)
    cni_config(state)
    cenv = dict(env, PATH=f"{containerd_bin()}:{env.get('PATH', '')}")
    start(state, "containerd", [containerd_bin() / "containerd", "--config",
                                containerd_config(state)], env=cenv)
    sock = state / "containerd" / "containerd.sock"
    wait_for("containerd's socket", sock.is_socket, 60, state, "containerd")
    for archive in (pause_archive(), workload_archive()):
        ctr(state, "images", "import", "--all-platforms", archive)

    KUBELET_ROOT.mkdir(parents=True, exist_ok=True)
    start(state, "kubelet", [
        k8s / "kubelet", f"--config={kubelet_config(state, ip)}",
        f"--kubeconfig={state / 'kubelet.kubeconfig'}", f"--hostname-override={NODE_NAME}",
        f"--node-ip={ip}", f"--root-dir={KUBELET_ROOT}", "--v=1"], env=cenv)
    start(state, "kube-proxy", [k8s / "kube-proxy", f"--config={kube_proxy_config(state, ip)}",
                                "--v=1"])
    wait_for(f"node {NODE_NAME} Ready", lambda: kubectl(
        state, "get", "node", NODE_NAME, "-o",
        "jsonpath={.status.conditions[?(@.type=='Ready')].status}").strip() == "True",
        180, state, "kubelet")
    # Pods are refused until the controller manager has made the namespace's ServiceAccount.
    wait_for("the default ServiceAccount", lambda: kubectl(
        state, "get", "serviceaccount", "default", "-o", "name").strip(), 60, state,
        "kube-controller-manager")
    t_start = time.monotonic() - t1
    (state / "timings.json").write_text(json.dumps({"build_s": round(t_build, 1),
                                                    "start_s": round(t_start, 1)}))
    say(f"node {NODE_NAME} Ready: build/check {t_build:.0f} s, start {t_start:.0f} s")
    print(f"export KUBECONFIG={state / 'admin.kubeconfig'}")


def started_bin(state: Path, name: str, default: Path) -> Path:
    """The binary directory the cluster in `state` was started from (its cache may not be the
    one this process would build into: GEMINI_CLUSTER_CACHE)."""
    with contextlib.suppress(OSError, ValueError, KeyError):
        return Path(json.loads((state / "bin.json").read_text())[name])
    return default


def ctr(state: Path, *args: str | Path, check: bool = True) -> str:
    return run([started_bin(state, "containerd", containerd_bin()) / "ctr", "--address",
                state / "containerd" / "containerd.sock", "-n", "k8s.io", *args],
               check=check, quiet=not check)


def mounts_under(*roots: Path) -> list[str]:
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].replace("\\040", " ")
        if any(point == str(r) or point.startswith(f"{r}/") for r in roots):
            found.append(point)
    return found


def stop_pid(pid: int, timeout: float = 20) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    if alive(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def our_shims(state: Path) -> list[int]:
    """The runc shims started by this cluster's containerd (by their executable's path)."""
    shim = str(started_bin(state, "containerd", containerd_bin()) / "containerd-shim-runc-v2")
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if os.readlink(entry / "exe") == shim:
                    pids.append(int(entry.name))
    return pids


def down(state: Path, quiet: bool = False) -> None:
    # kubelet first, so that it does not start what is being stopped; then every container.
    for name in ("kube-proxy", "kubelet"):
        pid = component_pid(state, name)
        if pid:
            stop_pid(pid)
    if component_pid(state, "containerd"):
        for task in ctr(state, "tasks", "ls", "-q", check=False).split():
            ctr(state, "tasks", "kill", "-a", "-s", "SIGKILL", task, check=False)
        time.sleep(1)
        for task in ctr(state, "tasks", "ls", "-q", check=False).split():
            ctr(state, "tasks", "delete", "-f", task, check=False)
    for name in reversed(COMPONENTS):
        pid = component_pid(state, name)
        if pid:
            stop_pid(pid)
    for pid in our_shims(state):
        stop_pid(pid, 5)
    # Deepest first: pods' volumes, containerd's rootfs and sandbox mounts (shm, netns).
    for point in sorted(mounts_under(state, KUBELET_ROOT, Path("/run/netns")),
                        key=len, reverse=True):
        if point.startswith("/run/netns") and "cni-" not in point:
            continue
        subprocess.run(["umount", "-l", point], capture_output=True)
    proxy = started_bin(state, "k8s", k8s_bin()) / "kube-proxy"
    if proxy.exists():
        subprocess.run([proxy, "--cleanup"], capture_output=True)
    iptables_cleanup()
    subprocess.run(["ip", "link", "delete", BRIDGE], capture_output=True)
    with contextlib.suppress(OSError, ValueError):
        for name, value in json.loads((state / "sysctls.json").read_text()).items():
            if value is not None:
                write_sysctl(name, value)
    remove_cgroups()
    created = []
    with contextlib.suppress(OSError):
        created = [Path(p) for p in (state / "created").read_text().split()]
    for path in created:
        if path in (KUBELET_ROOT, GEMINI_STATE):
            shutil.rmtree(path, ignore_errors=True)
    shutil.rmtree(state, ignore_errors=True)
    if not quiet:
        say(f"stopped; {state} removed")


def iptables_cleanup() -> None:
    """What kubelet (KUBE-FIREWALL, KUBE-KUBELET-CANARY), kube-proxy (KUBE-*) and the CNI bridge
    plugin (CNI-<hash>, ipMasq) leave in iptables and ip6tables: the rules that jump to those
    chains, then the chains. `kube-proxy --cleanup` removes only kube-proxy's own."""
    for command in ("iptables", "ip6tables"):
        if shutil.which(command) is None:
            continue
        for table in ("filter", "nat", "mangle"):
            rules = run([command, "-t", table, "-S"], check=False, quiet=True).splitlines()
            ours = [r.split()[1] for r in rules
                    if r.startswith("-N ") and r.split()[1].startswith(("KUBE-", "CNI-"))]
            for rule in rules:
                words = shlex.split(rule)
                if (words[:1] == ["-A"] and words[1] not in ours
                        and any(w in ours for w in words)):
                    subprocess.run([command, "-t", table, "-D", *words[1:]],
                                   capture_output=True)
            for chain in ours:
                subprocess.run([command, "-t", table, "-F", chain], capture_output=True)
            for chain in ours:
                subprocess.run([command, "-t", table, "-X", chain], capture_output=True)


def remove_cgroups() -> None:
    """kubelet's kubepods hierarchy (cgroupfs driver), deepest directories first."""
    for hierarchy in Path("/sys/fs/cgroup").iterdir():
        top = hierarchy / "kubepods"
        if not top.is_dir():
            continue
        dirs = sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: len(p.parts),
                      reverse=True)
        for path in [*dirs, top]:
            with contextlib.suppress(OSError):
                path.rmdir()


def status(state: Path) -> int:
    missing = 0
    for name in COMPONENTS:
        pid = component_pid(state, name)
        print(f"{name:24} {'running, pid ' + str(pid) if pid else 'not running'}")
        missing += pid is None
    if component_pid(state, "kube-apiserver"):
        print(kubectl(state, "get", "nodes", "-o", "wide", check=False))
    return 1 if missing else 0


def env_json(state: Path) -> dict[str, str]:
    return {"kubeconfig": str(state / "admin.kubeconfig"), "state": str(state),
            "kubectl": str(started_bin(state, "k8s", k8s_bin()) / "kubectl"),
            "ctr": str(started_bin(state, "containerd", containerd_bin()) / "ctr"),
            "helm": str(started_bin(state, "helm", helm_bin()) / "helm"),
            "containerd_socket": str(state / "containerd" / "containerd.sock"),
            "node": NODE_NAME, "cache": str(CACHE), "kubelet_root": str(KUBELET_ROOT),
            "gemini_state": str(GEMINI_STATE), "workload_image": WORKLOAD_IMAGE,
            "cdi_dir": str(state / "cdi"), "servicemonitor_crd": str(servicemonitor_crd())}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=("up", "down", "status", "env", "build", "restart"))
    parser.add_argument("component", nargs="?", choices=COMPONENTS,
                        help="restart: the component to stop and start again")
    parser.add_argument("--state", type=Path, default=DEFAULT_STATE)
    args = parser.parse_args(argv)
    (CACHE / "logs").mkdir(parents=True, exist_ok=True)
    try:
        if args.command == "build":
            build_all()
        elif args.command == "up":
            up(args.state)
        elif args.command == "down":
            down(args.state)
        elif args.command == "restart":
            if args.component is None:
                parser.error("restart needs a component")
            restart(args.state, args.component)
        elif args.command == "status":
            return status(args.state)
        else:
            print(json.dumps(env_json(args.state), indent=1))
    except ClusterError as error:
        print(f"cluster: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
