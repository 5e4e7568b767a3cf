"""A per-user daemon's host-wide claims on the GPUs it serves (the rule: vgpu_runtime/gpulock.py).

gemini-run starts its daemon with gpu_lock_dir set: before the first allocation on a GPU is
served, the daemon claims that GPU for its user, and an allocation on a GPU that another user's
daemon (or the host daemon) holds is not served: its record is refused with the holder's uid and
what to do, which gemini-run prints. A GPU is released as soon as no allocation of this daemon
is left on it, so that the machine's users take turns rather than wait for an idle exit. A
node's daemon (no gpu_lock_dir) claims nothing.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable

from vgpu_runtime import gpulock
from vgpu_runtime.contracts.allocation import AllocationRecord, RecordError

log = logging.getLogger(__name__)


class ServedGpus:
    def __init__(self, lock_dir: str | None) -> None:
        self.claims = None if not lock_dir else gpulock.GpuClaims(lock_dir, os.geteuid())

    def claim(self, record: AllocationRecord) -> None:
        """Hold every GPU of `record`, or raise RecordError saying who holds one."""
        if self.claims is None:
            return
        for gpu in record.gpus:
            try:
                self.claims.claim(gpu.uuid)
            except gpulock.GpuLockError as err:
                raise RecordError(str(err)) from None
            log.debug("GPU claimed", extra={"gpu": gpu.uuid})

    def keep(self, records: Iterable[AllocationRecord]) -> None:
        """Release the GPUs no served allocation is on any more."""
        if self.claims is None:
            return
        for uuid in self.claims.keep({g.uuid for r in records for g in r.gpus}):
            log.info("GPU released: no allocation of this daemon is on it", extra={"gpu": uuid})

    def close(self) -> None:
        if self.claims is not None:
            self.claims.close()
