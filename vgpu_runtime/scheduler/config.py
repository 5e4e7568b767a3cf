"""gemini-scheduler's settings: flags > environment (GEMINI_*) > YAML file.

The token scheduler's constants are settings too, with the algorithm's defaults
(`vgpu_runtime.burst.scheduler.SchedulerConfig`, where each default is explained). Why the daemon's
own additions are what they are:

* `limit_policy`: `work-conserving` caps an allocation without a limit of its own at
  `default_limit` (1.0: an idle GPU is lent to whoever wants it), `strict` at its request.
* `idle_release` (2 ms): the Gemini burst-merge gap. Launches less than that apart belong to one
  burst, so a holder whose last burst ended with a host sync and that launched nothing for that
  long has finished its burst; keeping the token longer only makes a waiting tenant wait.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from vgpu_runtime import paths
from vgpu_runtime.burst.scheduler import SchedulerConfig as AlgorithmConfig
from vgpu_runtime.common import config as cfg

_ALGORITHM = AlgorithmConfig()
LIMIT_POLICIES = ("work-conserving", "strict")


@dataclass(frozen=True)
class SchedulerConfig:
    state_dir: str = cfg.setting(
        paths.default_state_dir(), "state directory holding allocations/ and channels/",
        cfg.text, "DIR")
    poll_interval: float = cfg.setting(
        0.2, "seconds between scans of the allocation records", cfg.number(0.01, 10), "SECONDS")
    default_limit: float = cfg.setting(
        1.0, "cap on an allocation's GPU-time share when its record sets none "
        "(work-conserving policy)", cfg.number(0.000001, 1.0), "FRACTION")
    limit_policy: str = cfg.setting(
        "work-conserving", "limit of an allocation whose record sets none: work-conserving "
        "(default_limit) or strict (its request)", cfg.choice(*LIMIT_POLICIES), "POLICY")
    window: float = cfg.setting(
        _ALGORITHM.window, "seconds of history a GPU-time share is measured over",
        cfg.number(0.1, 3600), "SECONDS")
    min_quota: float = cfg.setting(
        _ALGORITHM.min_quota, "shortest token quota, seconds", cfg.number(0.0001, 10), "SECONDS")
    max_quota: float = cfg.setting(
        _ALGORITHM.max_quota, "longest token quota, seconds", cfg.number(0.0001, 10), "SECONDS")
    cycle: float = cfg.setting(
        _ALGORITHM.cycle, "seconds of one round; a tenant's base quota is its part of it",
        cfg.number(0.0001, 60), "SECONDS")
    catch_up: float = cfg.setting(
        _ALGORITHM.catch_up, "part of its deficit a tenant below its request recovers per grant",
        cfg.number(0.0, 1.0), "FRACTION")
    revoke_grace: float = cfg.setting(
        _ALGORITHM.revoke_grace, "seconds a holder may overrun its quota before revocation",
        cfg.number(0.0, 10), "SECONDS")
    burst_merge_gap: float = cfg.setting(
        _ALGORITHM.burst_merge_gap, "kernel bursts closer than this are one burst, seconds",
        cfg.number(0.0, 1.0), "SECONDS")
    burst_history: float = cfg.setting(
        _ALGORITHM.burst_history, "seconds of bursts a quota estimate looks at",
        cfg.number(0.01, 3600), "SECONDS")
    idle_release: float = cfg.setting(
        0.002, "a holder that launched nothing this long after its last sync gives the token "
        "back early when another tenant waits, seconds", cfg.number(0.0001, 10), "SECONDS")
    log_level: str = cfg.setting(
        "info", "log level", cfg.choice("debug", "info", "warning", "error"), "LEVEL")
    log_format: str = cfg.setting("json", "log format", cfg.choice("json", "text"), "FORMAT")

    def algorithm(self) -> AlgorithmConfig:
        """The token scheduler's constants, from the settings of the same names."""
        names = [f.name for f in dataclasses.fields(AlgorithmConfig)]
        return AlgorithmConfig(**{name: getattr(self, name) for name in names})

    def check(self) -> None:
        """Relations between settings; raises cfg.ConfigError naming them."""
        if self.min_quota > self.max_quota:
            raise cfg.ConfigError(f"min_quota ({self.min_quota}) must not exceed max_quota "
                                  f"({self.max_quota})")
        if self.max_quota >= self.window:
            raise cfg.ConfigError(f"max_quota ({self.max_quota}) must be shorter than window "
                                  f"({self.window})")

    def limit_for(self, record_limit: float | None, request: float) -> float:
        """The cap on one allocation's share of one GPU: its own, else the policy's."""
        if record_limit is not None:
            limit = record_limit
        elif self.limit_policy == "strict":
            limit = request
        else:
            limit = self.default_limit
        return min(1.0, max(limit, request))   # never below what it is guaranteed
