"""The contract of names: every file, directory and variable the node's programs share.

The device plugin, the node daemon, gemini-run, the CLI and the hook find one another's files
through the names here and nowhere else; each shared file's format lives with its one writer's
reader module (allocation.py: records and bindings; nodefiles.py: health.json, slices.json).
Host paths are defaults that configuration may change; container paths are fixed, since
the hook inside every container finds its channel through them.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

RESOURCE_NAME = "gemini.ai/vgpu"

DEFAULT_KUBELET_DIR = "/var/lib/kubelet/device-plugins"
DEFAULT_POD_RESOURCES_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"
DEFAULT_STATE_DIR = "/var/lib/gemini"

# Inside <state-dir>, with each file's one writer.
ALLOCATIONS_SUBDIR = "allocations"   # allocation records: the plugin, gemini-run
BINDINGS_SUBDIR = "bindings"         # pod bindings: the daemon
CHANNELS_SUBDIR = "channels"         # channel directories: the allocators make, the daemon serves
PAGES_SUBDIR = "pages"               # token and activity pages: the daemon
LIB_SUBDIR = "lib"                   # interposer libraries: gemini-install-hook
HEALTH_FILE_NAME = "health.json"     # GPU health: the plugin
SLICES_FILE_NAME = "slices.json"     # slice counts per GPU: the plugin
LOCK_NAME = "scheduler.lock"         # one daemon per state directory
CONTROL_SOCKET_NAME = "scheduler.sock"   # the daemon's control socket
RUN_LOCK_NAME = "run.lock"           # gemini-run's admission lock
HOST_MARKER_NAME = "host.json"       # the host daemon's: this machine's GPUs are the host's
HOST_SOCKET_NAME = "host.sock"       # the host daemon's socket for every user of its group
HOST_CHANNELS_SUBDIR = "host-channels"   # the host daemon's channel directories
BINDINGS_DIR_MODE = 0o700
PAGES_DIR_MODE = 0o700
# A GPU is cut into at most this many slices: "<uuid>::<n>" stays well under kubelet's
# 63-character device IDs, and a share k/N is recovered exactly from its float (share.py).
MAX_SLICES_PER_GPU = 1000
# channels/ is its owner's alone: a container reaches its own channel through the bind mount of
# the leaf, which needs no search permission on the host's parents, and nobody else on the host
# can reach any channel, whatever its name (allocation IDs are hashes of guessable slice IDs).
CHANNELS_DIR_MODE = 0o700
# The host daemon serves every user of a machine: host-channels/ lets them pass (never list) to
# their own channel, <id>/ (root's, 0711), whose socket is theirs alone (0600, chowned).
HOST_CHANNELS_DIR_MODE = 0o711

# The host daemon: one per machine, installed by an administrator (gemini-host install); its
# socket's group names the users it serves, and its metrics port is not the node daemon's.
DEFAULT_HOST_GROUP = "gemini"
HOST_METRICS_PORT = 9402
# Host-wide GPU locks (gpulock.py): a root-owned sticky directory every user can lock in.
DEFAULT_GPU_LOCK_DIR = "/run/lock"
ENV_GPU_LOCK_DIR = "GEMINI_GPU_LOCK_DIR"

# The interposer's file name changes with its sources: hooklib.library_name(), which the build
# writes beside the library (the contracts never import the build).


def _wire_string(name: str) -> str:
    """A string the hook's wire header defines (#define NAME "value"): the channel's place
    and the daemon's socket name are defined once, there, for the hook and for Python."""
    header = Path(__file__).parent / "gemini_wire.h"
    found = re.search(rf'^#define {name} "([^"]*)"$', header.read_text(), re.M)
    if found is None:
        raise RuntimeError(f"{header} does not define {name}")
    return found.group(1)


# Inside a container.
CONTAINER_LIB_DIR = "/opt/gemini/lib"
CONTAINER_CHANNEL_DIR = _wire_string("GM_POD_CHANNEL_DIR")

# The loader's preload file, for the `preload-file` injection method.
CONTAINER_PRELOAD_FILE = "/etc/ld.so.preload"
# Over MPS (the node setting mps): where a container finds the MPS control daemon's pipes, and
# the shared memory its MPS server maps, which must be the server's own /dev/shm.
CONTAINER_MPS_PIPE_DIR = "/opt/gemini/mps"
SHM_DIR = "/dev/shm"
DEFAULT_MPS_SHM_DIR = "/run/gemini/mps/shm"   # a host tmpfs (/run), no privileged mount needed

# Inside a channel directory. Kept short: a Unix socket path must fit in 107 bytes.
CHANNEL_SOCKET_NAME = _wire_string("GM_CHANNEL_SOCKET_NAME")
CHANNEL_PRELOAD_NAME = "ld.so.preload"   # bind-mounted at CONTAINER_PRELOAD_FILE
UNIX_PATH_MAX = 107

# Every program's state directory when no flag names one (the daemon's own config reads it too).
ENV_STATE_DIR = "GEMINI_STATE_DIR"
# A container's environment (containerenv.py builds it for Allocate and gemini-run alike).
# The hook reads these two to find its channel:
ENV_CHANNEL_DIR = "GEMINI_CHANNEL_DIR"
ENV_ALLOCATION_ID = "GEMINI_ALLOCATION_ID"
# Information for the workload only: the hook never reads them (its limits come from the
# daemon's hello), so changing them changes nothing the node enforces. The share and the
# entitled memory limit of the allocation's first GPU.
ENV_SHARE = "GEMINI_VGPU_SHARE"
ENV_MEMORY_LIMIT = "GEMINI_VGPU_MEMORY_LIMIT"


def default_state_dir() -> str:
    """The node's state directory for root; a per-user one for anyone else (gemini-run)."""
    if os.geteuid() == 0:
        return DEFAULT_STATE_DIR
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        return os.path.join(runtime, "gemini")
    return f"/tmp/gemini-{os.geteuid()}"


def allocations_dir(state_dir: str | Path) -> Path:
    return Path(state_dir) / ALLOCATIONS_SUBDIR


def bindings_dir(state_dir: str | Path) -> Path:
    return Path(state_dir) / BINDINGS_SUBDIR


def pages_dir(state_dir: str | Path) -> Path:
    return Path(state_dir) / PAGES_SUBDIR


def health_file(state_dir: str | Path) -> Path:
    return Path(state_dir) / HEALTH_FILE_NAME


def slices_file(state_dir: str | Path) -> Path:
    return Path(state_dir) / SLICES_FILE_NAME


def lock_file(state_dir: str | Path) -> Path:
    return Path(state_dir) / LOCK_NAME


def control_socket(state_dir: str | Path) -> Path:
    return Path(state_dir) / CONTROL_SOCKET_NAME


def host_marker(state_dir: str | Path) -> Path:
    return Path(state_dir) / HOST_MARKER_NAME


def host_socket(state_dir: str | Path) -> Path:
    return Path(state_dir) / HOST_SOCKET_NAME


def host_channels_dir(state_dir: str | Path) -> Path:
    return Path(state_dir) / HOST_CHANNELS_SUBDIR


def channels_dir(state_dir: str | Path) -> Path:
    return Path(state_dir) / CHANNELS_SUBDIR


def channel_dir(state_dir: str | Path, allocation_id: str) -> Path:
    return channels_dir(state_dir) / allocation_id


def channel_socket(channel: str | Path) -> Path:
    return Path(channel) / CHANNEL_SOCKET_NAME


def mps_pipe_dir(state_dir: str | Path) -> Path:
    """The MPS control daemon's pipes (CUDA_MPS_PIPE_DIRECTORY) where the daemon runs tenants
    over MPS: its clients are given this directory."""
    return Path(state_dir) / "mps" / "pipe"


def mps_log_dir(state_dir: str | Path) -> Path:
    return Path(state_dir) / "mps" / "log"


def mps_shm_id(state_dir: str | Path) -> Path:
    """The MPS control daemon's shared-memory identity: a random token that whoever starts the
    control daemon writes here and, under mps_shm_name(), into the /dev/shm it runs with. The
    plugin compares the two before it gives a container that /dev/shm (mps_shm_dir)."""
    return Path(state_dir) / "mps" / "shm-id"


def mps_shm_name(state_dir: str | Path) -> str:
    """The identity's name in the shared /dev/shm, one per state directory."""
    digest = hashlib.sha256(os.fsencode(os.path.abspath(state_dir))).hexdigest()[:16]
    return f"gemini-mps-{digest}.id"


def default_hook_dir(state_dir: str | Path) -> Path:
    return Path(state_dir) / LIB_SUBDIR


def fits_unix_socket(path: str | Path) -> bool:
    return len(os.fsencode(str(path))) <= UNIX_PATH_MAX
