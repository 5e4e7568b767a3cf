"""gemini-mps-control: runs the MPS control daemon of a node's state directory in the foreground,
as the container of its own that daemonset/components/mps gives it.

It runs only where its /dev/shm is a tmpfs of its own (every tenant writes it: its size is the
cap on what they can fill; allow_shared_shm accepts another), marks that /dev/shm
(vgpu_runtime.daemon.mps), makes the pipe and log directories, and becomes
`nvidia-cuda-mps-control -f` (exec: the control daemon is the container's main process and takes
its signals). The node daemon, with mps_manage off, adopts it. Where one already answers on
those pipes it says so and exits 1, since two control daemons on one pipe directory would split
the tenants over two servers.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass

from vgpu_runtime.common import cli, logs
from vgpu_runtime.common import config as cfg
from vgpu_runtime.daemon.mps import MpsControl, MpsError, mps_control_setting, shm_refusal

log = logging.getLogger("gemini-mps-control")
PROG = "gemini-mps-control"


@dataclass(frozen=True)
class MpsControlConfig:
    state_dir: str = cfg.node_setting("state_dir")
    mps_control: str = mps_control_setting()
    allow_shared_shm: bool = cfg.setting(
        False, "run even where /dev/shm is not a tmpfs of its own (a directory of the host's "
        "/run, say), which any tenant could fill", cfg.boolean, "BOOL")
    log_level: str = cfg.setting("info", "debug|info|warning|error",
                                 cfg.choice("debug", "info", "warning", "error"), "LEVEL")
    log_format: str = cfg.setting("json", "json|text", cfg.choice("json", "text"), "FORMAT")


def main(argv: Sequence[str] | None = None) -> int:
    try:
        config = cfg.load(MpsControlConfig, argv, prog=PROG,
                          description="Run the MPS control daemon of a node's state directory "
                                      "in the foreground, for the node daemon to adopt")
    except cfg.ConfigError as err:
        cli.error(PROG, str(err))
        return 2
    logs.setup(config.log_level, config.log_format)
    control = MpsControl(config.state_dir, config.mps_control)
    try:
        program = control.resolved()
        if control.answers():
            cli.error(PROG, f"an MPS control daemon already answers on {control.pipe_dir}; "
                            "stop it first (echo quit | nvidia-cuda-mps-control with "
                            "CUDA_MPS_PIPE_DIRECTORY set to that directory)")
            return 1
        refusal = shm_refusal()
        if refusal is not None:
            if not config.allow_shared_shm:
                cli.error(PROG, refusal)
                return 1
            log.warning("running with a shared /dev/shm (allow_shared_shm)",
                        extra={"reason": refusal})
        control.make_dirs()
        control.mark_shm()
    except (MpsError, OSError) as err:
        cli.error(PROG, str(err))
        return 1
    log.info("starting the MPS control daemon", extra={"pipe_dir": str(control.pipe_dir),
                                                       "shm_mark": str(control.shm_mark)})
    os.execve(program, [program, "-f"], control.environment())
    return 1   # not reached


if __name__ == "__main__":
    raise SystemExit(main())
