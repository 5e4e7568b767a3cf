"""scripts/cluster/cluster.py's cache, without building anything: what a finished build keeps."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "cluster" / "cluster.py"


@pytest.fixture
def cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.setenv("GEMINI_CLUSTER_CACHE", str(tmp_path / "cache"))
    spec = importlib.util.spec_from_file_location("cluster_script_under_test", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    assert tmp_path / "cache" == module.CACHE
    return module


def test_a_finished_build_keeps_the_current_binaries_alone(cluster: ModuleType) -> None:
    """Go's build cache, other versions' entries and half builds go; the current entries, the
    logs and what the script did not make stay."""
    cache: Path = cluster.CACHE
    current = [cluster.k8s_bin().parent, cluster.etcd_bin().parent,
               cluster.containerd_bin().parent, cluster.cni_bin().parent,
               cluster.helm_bin().parent, cluster.monitoring_dir()]
    for entry in current:
        (entry / "bin").mkdir(parents=True)
        (entry / "bin" / "tool").write_bytes(b"binary")
    for archive in (cluster.pause_archive(), cluster.workload_archive()):
        archive.write_bytes(b"archive")
    (cache / "logs").mkdir()
    (cache / "logs" / "build.log").write_text("kept")
    stale = [cache / "go-build" / "00", cache / "k8s-v1.33.0-0123456789" / "bin",
             cache / "helm-v4.0.0-0123456789.partial", cache / "pause-0123456789.oci.tar"]
    for path in stale:
        if path.suffix == ".tar":
            path.write_bytes(b"old")
        else:
            path.mkdir(parents=True)
            (path / "f").write_bytes(b"old")
    (cache / "notes.txt").write_text("someone else's")

    cluster.prune_cache()

    left = sorted(p.name for p in cache.iterdir())
    assert left == sorted([*(e.name for e in current), cluster.pause_archive().name,
                           cluster.workload_archive().name, "logs", "notes.txt"])
    assert all((e / "bin" / "tool").read_bytes() == b"binary" for e in current)
    assert (cache / "logs" / "build.log").read_text() == "kept"
