"""What `gemini-vgpu status` shows each user of the host daemon: theirs, and what is free.

Root sees the daemon's whole answer. Any other user sees every GPU and what is free on it (time
and memory), their own allocations in full, and of other users' only how many there are on each
GPU and what they take together: never their ids (which lead to their channels), processes or
figures one by one, and no corrupt records (their paths name allocations). Where the metrics
port is, every user is told: host.json says it to all already, and the README documents it.
"""

from __future__ import annotations

from typing import Any

OTHER_HOLDER = "another user"


def free_memory(status: dict[str, Any]) -> dict[str, int]:
    """Per GPU, the memory limits of every allocation on it, added up."""
    allocated: dict[str, int] = {}
    for entry in status.get("allocations", []):
        for gpu in entry["gpus"]:
            allocated[gpu["uuid"]] = allocated.get(gpu["uuid"], 0) + int(gpu["memory_limit"])
    return allocated


def for_user(status: dict[str, Any], uid: int) -> dict[str, Any]:
    allocated = free_memory(status)
    node = dict(status.get("node", {}))
    node["gpus"] = [gpu | {"memory_allocated": allocated.get(gpu["uuid"], 0)}
                    for gpu in node.get("gpus", [])]
    viewer = {"uid": uid, "host": True}
    if uid == 0:
        return status | {"node": node, "viewer": viewer | {"everyone": True}}
    own = {a["id"] for a in status.get("allocations", []) if a.get("owner_uid") == uid}
    gpus = []
    for gpu in status.get("gpus", []):
        theirs = [t for t in gpu["tenants"] if t["allocation"] in own]
        others = [t for t in gpu["tenants"] if t["allocation"] not in own]
        holder = gpu["holder"]
        gpus.append({
            "uuid": gpu["uuid"], "gate": gpu["gate"], "window_s": gpu.get("window_s"),
            "holder": holder if holder in own or holder is None else OTHER_HOLDER,
            "holder_remaining_ms": gpu.get("holder_remaining_ms") if holder in own else None,
            "tenants": theirs,
            "others": {"allocations": len(others),
                       "request": round(sum(t["request"] for t in others), 6),
                       "memory_limit": sum(int(t["memory_limit"]) for t in others)}})
    daemon = {k: v for k, v in status.get("daemon", {}).items()
              if k in ("pid", "version", "state_dir", "started_at", "default_limit",
                       "limit_policy", "idle_exit", "token_settings", "ready", "metrics")}
    node.pop("mqtt", None)
    return {"daemon": daemon, "node": node, "viewer": viewer,
            "allocations": [a for a in status.get("allocations", []) if a["id"] in own],
            "gpus": gpus, "corrupt_records": []}
