"""gemini-uninstall: the Helm chart's pre-delete hook. Deletes the node DaemonSet in the foreground
and waits until it is gone, so that every node pod stops while its ServiceAccount and RBAC
still exist: each node daemon then sees its DaemonSet being deleted, removes what it put on its
node but what running pods use, and says so in an Event on the Node (daemon/uninstall.py).
Without this step `helm uninstall` would delete the RBAC with the DaemonSet and the daemons,
stopping a moment later, could no longer ask.

Exit 0 once the DaemonSet is gone (or was never there); 1 when it is still there after
--timeout seconds, so that `helm uninstall` fails and says so instead of leaving the nodes'
state in doubt (`helm uninstall --no-hooks` skips this step and the cleanup).
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

from vgpu_runtime.common import cli, logs
from vgpu_runtime.common import config as cfg

log = logging.getLogger("gemini-uninstall")
PROG = "gemini-uninstall"
POLL = 1.0   # seconds between looks at the DaemonSet


@dataclass(frozen=True)
class UninstallConfig:
    namespace: str = cfg.setting("gemini-system", "the DaemonSet's namespace", cfg.text,
                                 "NAMESPACE")
    daemonset: str = cfg.setting("gemini-vgpu-node", "the node DaemonSet", cfg.text, "NAME")
    timeout: float = cfg.setting(240.0, "seconds to wait for its pods to stop",
                                 cfg.number(1, 3600), "SECONDS")
    kube_api_url: str | None = cfg.setting(
        None, "Kubernetes API URL instead of the in-cluster config (tests)",
        cfg.optional(cfg.text), "URL")
    log_level: str = cfg.setting(
        "info", "log level", cfg.choice("debug", "info", "warning", "error"), "LEVEL")
    log_format: str = cfg.setting("json", "log format", cfg.choice("json", "text"), "FORMAT")


async def remove(config: UninstallConfig) -> int:
    from vgpu_runtime.daemon.pods.kube import KubeApi, KubeError

    kube = KubeApi(config.kube_api_url)
    where = f"DaemonSet {config.namespace}/{config.daemonset}"
    try:
        if not await kube.delete_daemonset(config.namespace, config.daemonset):
            print(f"{PROG}: no {where}: nothing to stop")
            return 0
        print(f"{PROG}: deleting {where} in the foreground; each node daemon clears its node "
              "as it stops (an Event on each Node says what it kept and why)", flush=True)
        deadline = time.monotonic() + config.timeout
        while time.monotonic() < deadline:
            try:
                state = await kube.daemonset_state(config.namespace, config.daemonset)
            except KubeError as err:
                log.warning("cannot read the DaemonSet; trying again", extra={"error": str(err)})
            else:
                if state == "gone":
                    print(f"{PROG}: {where} and its pods are gone")
                    return 0
            await asyncio.sleep(POLL)
        cli.error(PROG, f"{where} still has pods after {config.timeout:g} s; see `kubectl -n "
                        f"{config.namespace} get pods`, or uninstall with --no-hooks to skip "
                        "the nodes' cleanup")
        return 1
    except KubeError as err:
        cli.error(PROG, str(err))
        return 1
    finally:
        kube.close()


def main(argv: Sequence[str] | None = None) -> int:
    try:
        config = cfg.load(UninstallConfig, argv, prog=PROG,
                          description=__doc__.split("\n\n", 1)[0].replace("\n", " "))
    except cfg.ConfigError as err:
        cli.error(PROG, str(err))
        return 2
    logs.setup(config.log_level, config.log_format)
    try:
        return asyncio.run(remove(config))
    except Exception as err:   # no in-cluster config
        cli.error(PROG, str(err))
        return 1


if __name__ == "__main__":
    sys.exit(main())
