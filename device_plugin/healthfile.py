"""<state-dir>/health.json: the plugin's view of GPU health, for the node daemon's telemetry
(its format: vgpu_runtime.contracts.nodefiles).

Written atomically (temporary file, fsync, rename) after every health change and at start, so
the daemon reads the old file or the new one, never half of one. The plugin is the only writer.
"""

from __future__ import annotations

import logging
from pathlib import Path

from device_plugin.health import HealthTracker
from vgpu_runtime.common.atomicfile import write_atomic
from vgpu_runtime.contracts import nodefiles, paths

log = logging.getLogger(__name__)

health_file = paths.health_file


def health_document(tracker: HealthTracker) -> dict[str, nodefiles.GpuHealth]:
    return {uuid: nodefiles.GpuHealth(tracker.state(uuid).healthy, tracker.state(uuid).reason)
            for uuid in tracker.all_uuids()}


def write_health(state_dir: str | Path, tracker: HealthTracker) -> None:
    """Never raises: health reaches kubelet through ListAndWatch whatever happens to this file."""
    target = health_file(state_dir)
    payload = nodefiles.encode_health(health_document(tracker))
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        # Not durable: it is rewritten on every change and re-created at every start.
        write_atomic(target, payload, durable=False)
    except OSError as err:
        log.warning("cannot write health file", extra={"path": str(target), "error": str(err)})


def publish_health(state_dir: str | Path, tracker: HealthTracker) -> None:
    """Write the file now and after every change of any GPU's health."""
    write_health(state_dir, tracker)
    tracker.on_change(lambda: write_health(state_dir, tracker))
