"""Uninstall: what the node daemon and its pod put on the host and on the Node goes as their
DaemonSet is deleted, except what a running pod still uses; an Event on the Node says which.

When. The daemon stops on SIGTERM for many reasons: a rolling update, its pod deleted by hand, a
drain, the DaemonSet deleted. Only the last is an uninstall, and only the API server knows it:
the daemon asks for its pod's controller and whether that DaemonSet is gone or marked for
deletion. The chart's pre-delete hook deletes the DaemonSet in the foreground and waits, so the
pods stop while their ServiceAccount and RBAC still exist (deleted with the rest, they would
stop after both are gone); kustomize users do the same with one kubectl command (README). Any
doubt (no API, no pod name, an error) keeps everything: a restart must never lose state.

What stays. A pod still running with an allocation maps its interposer from <state-dir>/lib and
its channel and token pages: those stay, with its record and binding, so an install later
serves it again; the Event names the pods. An allocation no running pod holds is collected as
after collect_grace (the daemon's collect: end_allocation), and so are its pages.

What goes. Only the state directory's known entries (paths.py), never an unknown name: with no
allocation left, all of them, the daemon's lock and control socket too. The directory itself
is the DaemonSet's hostPath (kubelet creates it, and it is this container's mount point): it
stays, empty. The labels the daemon set on its Node (pods/node.py) are removed.
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from vgpu_runtime import hooklib
from vgpu_runtime.contracts import allocation, paths
from vgpu_runtime.contracts.allocation import AllocationRecord, RecordError

log = logging.getLogger(__name__)

REASON = "GeminiVgpuUninstalled"
# The state directory's entries that are ours to remove, each with what it is.
KNOWN = {
    paths.ALLOCATIONS_SUBDIR: "allocation records",
    paths.BINDINGS_SUBDIR: "pod bindings",
    paths.CHANNELS_SUBDIR: "channel directories",
    paths.PAGES_SUBDIR: "token and activity pages",
    paths.LIB_SUBDIR: "interposer libraries",
    paths.HEALTH_FILE_NAME: "GPU health",
    paths.SLICES_FILE_NAME: "slice counts",
    paths.LOCK_NAME: "the daemon's lock",
    paths.CONTROL_SOCKET_NAME: "the daemon's control socket",
    paths.RUN_LOCK_NAME: "gemini-run's lock",
    "scheduler.log": "gemini-run's daemon log",
    "simulate": "the plugin's control directory for simulated GPUs (pluginconfig.py)",
}


@dataclass
class Cleanup:
    """What an uninstall removed from the state directory, and what it kept and why."""
    state_dir: str
    removed: list[str] = field(default_factory=list)        # paths relative to the state dir
    kept: dict[str, str] = field(default_factory=dict)      # relative path -> why

    def message(self, pods: list[str]) -> str:
        """The Node Event's text: what went, what stayed and why, what to do about it."""
        if not self.kept:
            return (f"gemini.ai/vgpu uninstalled from this node: removed everything in "
                    f"{self.state_dir} ({len(self.removed)} entries) and the node's gemini.ai "
                    "labels; the empty directory stays (the DaemonSet's hostPath)")
        why = "; ".join(f"{path}: {reason}" for path, reason in sorted(self.kept.items())[:8])
        more = f" (and {len(self.kept) - 8} more)" if len(self.kept) > 8 else ""
        still = (f" Pods still running with an allocation: {', '.join(sorted(pods))}; delete "
                 f"{self.state_dir} once they end, or install again and the daemon serves "
                 "and then collects them.") if pods else ""
        return (f"gemini.ai/vgpu uninstalled from this node: removed {len(self.removed)} "
                f"entries of {self.state_dir} and the node's gemini.ai labels; kept {why}"
                f"{more}.{still}")


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


def clean_state(state_dir: str | Path, kept_records: dict[str, str]) -> Cleanup:
    """Remove the state directory's entries but those the allocations of `kept_records` (id ->
    why it is kept, e.g. its pod runs) use. A record still on disk that is not in
    `kept_records` (its collection failed) or that cannot be read is kept too, with its
    library: it may be a running pod's."""
    top = Path(state_dir)
    out = Cleanup(str(top))
    kept = dict(kept_records)
    unreadable = False
    for path, record in allocation.scan_records(top):
        if isinstance(record, RecordError):
            unreadable = True
            out.kept[f"{paths.ALLOCATIONS_SUBDIR}/{path.name}"] = f"cannot be read: {record}"
        elif record.id not in kept:
            kept[record.id] = "its record could not be removed"
    records = {r.id: r for _, r in allocation.scan_records(top)
               if isinstance(r, AllocationRecord)}
    libraries = {records[i].hook_library for i in kept if i in records}
    for allocation_id, why in kept.items():
        out.kept[f"{paths.ALLOCATIONS_SUBDIR}/{allocation_id}.json"] = why

    def used(entry: str, child: Path) -> str | None:
        """Why `child` of a per-allocation directory stays, or None."""
        if entry in (paths.CHANNELS_SUBDIR, paths.BINDINGS_SUBDIR):
            owner = child.name.removesuffix(".json")
        elif entry == paths.PAGES_SUBDIR:
            owner = child.name.split(".", 1)[0]
        elif entry == paths.LIB_SUBDIR:
            if unreadable and child.name.startswith(hooklib.LIBRARY_PREFIX):
                return "an unreadable record may use it"
            return "a kept allocation's interposer" if child.name in libraries else None
        else:
            return None
        return "a kept allocation's" if owner in kept else None

    for name in KNOWN:
        path = top / name
        if not path.exists() and not path.is_symlink():
            continue
        if name == paths.ALLOCATIONS_SUBDIR and (kept or unreadable):
            continue   # the kept records, said above
        if (kept or unreadable) and name in (paths.CHANNELS_SUBDIR, paths.BINDINGS_SUBDIR,
                                             paths.PAGES_SUBDIR, paths.LIB_SUBDIR):
            for child in sorted(path.iterdir()):
                relative = f"{name}/{child.name}"
                stays = used(name, child)
                if stays is not None:
                    if name == paths.LIB_SUBDIR:
                        out.kept[relative] = stays
                    continue
                _try_remove(child, relative, out)
            continue
        _try_remove(path, name, out)
    for entry in sorted(top.iterdir()) if top.is_dir() else []:
        if entry.name not in KNOWN:
            out.kept[entry.name] = "not the daemon's (an unknown name): left for the operator"
    return out


def _try_remove(path: Path, relative: str, out: Cleanup) -> None:
    try:
        _remove(path)
    except FileNotFoundError:
        return
    except OSError as err:
        out.kept[relative] = f"cannot be removed: {err.strerror or err}"
        return
    out.removed.append(relative)


def node_labels_to_remove(labels: dict[str, str]) -> dict[str, str | None]:
    """The merge patch that removes the labels the daemon sets (pods/node.py); the operator's
    own (gemini.ai/vgpu.enabled, gemini.ai/vgpu.config) stay."""
    from vgpu_runtime.daemon.pods.node import LABEL_COUNT, LABEL_MODEL, LABEL_SLICES, LABEL_VERSION

    ours = (LABEL_COUNT, LABEL_MODEL, LABEL_SLICES, LABEL_VERSION)
    return {key: None for key in ours if key in labels}

