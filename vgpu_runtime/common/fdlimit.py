"""Open-file limit: a daemon with one socket per client raises its own soft limit.

A node daemon serves every process of every container over its own connection (200 containers x
4 processes is 800 sockets, plus channels' listening sockets and pages), past the usual soft
limit of 1024. The soft limit may be raised up to the hard limit without privileges.
"""

from __future__ import annotations

import logging
import resource

log = logging.getLogger(__name__)


def raise_open_file_limit(wanted: int | None = None) -> int:
    """Raise RLIMIT_NOFILE's soft limit to `wanted` (default: the hard limit), never lower it;
    returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if wanted is None else wanted
    if hard != resource.RLIM_INFINITY:
        target = min(target, hard)
    if soft != resource.RLIM_INFINITY and target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as err:
            log.warning("cannot raise the open-file limit", extra={
                "soft": soft, "hard": hard, "wanted": target, "error": str(err)})
    return soft
