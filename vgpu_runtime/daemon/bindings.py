"""The pod bindings: which pod each kubelet allocation serves, and the pod's overrides.

The files (<state-dir>/bindings/<id>.json) are this daemon's alone: it writes them when the pod
watch finds an allocation's pod and removes them when the allocation ends. They are read once at
start; after that this map is the truth and each change is written through.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

from vgpu_runtime import allocation
from vgpu_runtime.allocation import AllocationRecord, Binding, RecordError

log = logging.getLogger(__name__)


class PodBindings:
    def __init__(self, state_dir: str | Path) -> None:
        self.state_dir = Path(state_dir)
        self._by_id: dict[str, Binding] = {}

    def load(self) -> None:
        """The bindings on disk; an unreadable one is skipped (the pod watch binds its
        allocation again, replacing the file)."""
        for path, binding in allocation.scan_bindings(self.state_dir):
            if isinstance(binding, RecordError):
                log.error("ignoring unreadable pod binding", extra={"path": str(path),
                                                                     "error": str(binding)})
            else:
                self._by_id[binding.id] = binding

    def get(self, allocation_id: str) -> Binding | None:
        return self._by_id.get(allocation_id)

    def ids(self) -> set[str]:
        return set(self._by_id)

    def for_record(self, record: AllocationRecord) -> Binding | None:
        """The record's binding; a version-1 record's pod, which an older daemon wrote into
        it, is moved into this daemon's binding file the first time it is read."""
        binding = self._by_id.get(record.id)
        if binding is None and record.carried is not None and record.origin == "kubelet":
            binding = record.carried
            try:
                allocation.write_binding(self.state_dir, binding)
            except RecordError as err:
                log.error("cannot store the pod binding of a version-1 record; it holds in "
                          "memory", extra={"allocation": record.id, "error": str(err)})
            else:
                log.info("pod binding moved out of a version-1 record", extra={
                    "allocation": record.id, "namespace": binding.pod.namespace,
                    "pod": binding.pod.name, "limit": binding.limit,
                    "memory_limit": binding.memory_limit})
            self._by_id[record.id] = binding
        return binding

    def store(self, binding: Binding) -> None:
        """Write the binding, then keep it; RecordError (nothing kept) if it cannot be written."""
        allocation.write_binding(self.state_dir, binding)
        self._by_id[binding.id] = binding

    def drop(self, allocation_id: str) -> None:
        """Forget the allocation's binding and remove its file (a failure to is harmless: a
        binding without its record is dropped again at the next start's first poll)."""
        self._by_id.pop(allocation_id, None)
        with contextlib.suppress(OSError, RecordError):
            allocation.remove_binding(self.state_dir, allocation_id)
