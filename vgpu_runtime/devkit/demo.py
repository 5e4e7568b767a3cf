"""The README's first command (gemini-demo, through scripts/demo): a node advertising and
admitting vGPUs, then two programs sharing one GPU.

Admission: starts the real device plugin against the kubelet emulator in a temporary directory
(real GPUs when NVML finds any, otherwise two simulated ones), shows the node's capacity, admits
pods of 3, 5 and 4 slices, and shows a pod that fits the node's free count but no single GPU
refused. Sharing (sharedemo.py): two programs under gemini-run share a simulated GPU through the
real daemon and interposer over the fake CUDA driver; their shares and memory converge, live, to
what they asked for, and each is refused an allocation past its memory limit.

    gemini-demo [--simulate-gpus N] [--only admission|sharing] [--keep]
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import tempfile
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vgpu_runtime.common import cli
from vgpu_runtime.contracts import paths
from vgpu_runtime.devkit.kubelet_emulator import KubeletEmulator, Pod, describe_node
from vgpu_runtime.devkit.kubelet_emulator.plugin_process import PluginProcess
from vgpu_runtime.devkit.sharedemo import run_sharing

SLICES_PER_GPU = 10
SAMPLE_PODS = (("train-a", 3), ("infer-b", 5), ("notebook-c", 4))


def nvml_gpu_count() -> int:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return int(pynvml.nvmlDeviceGetCount())
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        return 0


def heading(text: str) -> None:
    print(f"\n\033[1m== {text}\033[0m" if sys.stdout.isatty() else f"\n== {text}")


def indent(text: str, prefix: str = "    ") -> str:
    return "\n".join(prefix + line for line in text.splitlines())


def gpu_of(device_id: str) -> str:
    return device_id.split("::")[0]


def show_response(response: Any) -> None:
    interesting = ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "LD_PRELOAD",
                   paths.ENV_SHARE, paths.ENV_MEMORY_LIMIT, paths.ENV_ALLOCATION_ID,
                   paths.ENV_CHANNEL_DIR)
    for key in interesting:
        if key in response.envs:
            print(f"      env    {key}={response.envs[key]}")
    for mount in response.mounts:
        mode = "ro" if mount.read_only else "rw"
        print(f"      mount  {mount.container_path} <- {mount.host_path} ({mode})")
    for device in response.devices:
        print(f"      device {device.container_path} ({device.permissions})")
    for cdi in response.cdi_devices:
        print(f"      cdi    {cdi.name}")


def show_pod(pod: Pod, gpu_names: dict[str, str]) -> None:
    if not pod.admitted:
        print(f"  {pod.namespace}/{pod.name}: REFUSED, reason {pod.reason}")
        print(indent(pod.message, "      "))
        return
    container = next(iter(pod.containers.values()))
    per_gpu = Counter(gpu_of(d) for d in container.device_ids)
    placed = ", ".join(f"{n} slices of {gpu_names.get(u, u)}" for u, n in per_gpu.items())
    print(f"  {pod.namespace}/{pod.name} (asks gemini.ai/vgpu: {container.requested}): "
          f"admitted, {placed}")
    show_response(container.response)


def free_per_gpu(kubelet: KubeletEmulator) -> Counter[str]:
    free = kubelet.healthy_ids() - kubelet.in_use()
    return Counter(gpu_of(d) for d in free)


async def run_demo(root: Path, simulate_gpus: int) -> int:
    kubelet = KubeletEmulator(root / "device-plugins", root / "pod-resources" / "kubelet.sock")
    plugin = PluginProcess(kubelet.directory, root / "state", gpus=simulate_gpus,
                           slices=SLICES_PER_GPU, args=["--log-format", "text"],
                           log_path=root / "plugin.log")
    await kubelet.start()
    try:
        heading("1. Device plugin registering with the (emulated) kubelet")
        source = f"{simulate_gpus} simulated GPUs" if simulate_gpus else "real GPUs (NVML)"
        print(f"  plugin: python -m device_plugin.main, {source}, {SLICES_PER_GPU} slices each")
        print(f"  kubelet socket dir: {kubelet.directory}")
        await plugin.start()
        try:
            await kubelet.wait_until(lambda: kubelet.allocatable() > 0, timeout=30)
        except AssertionError:
            if plugin.exited():
                print("  the plugin exited; its log:\n" + indent(plugin.log_text()[-3000:]))
                return 1
            raise
        gpus = sorted({gpu_of(d) for d in kubelet.devices[paths.RESOURCE_NAME]})
        gpu_names = {uuid: f"GPU {i} ({uuid[:12]}...)" for i, uuid in enumerate(gpus)}
        print(f"  registered: {len(gpus)} GPU(s) x {SLICES_PER_GPU} slices")

        heading("2. kubectl describe node (excerpt)")
        print(indent(describe_node(kubelet).split("Non-terminated")[0].rstrip(), "  "))

        heading("3. Admitting three pods (best fit: fill the fullest GPU that still fits)")
        for name, count in SAMPLE_PODS:
            show_pod(await kubelet.admit_pod(name, containers=[("main", count)]), gpu_names)

        heading("4. A pod that fits the node's free count but no single GPU")
        free = free_per_gpu(kubelet)
        total = sum(free.values())
        if len(free) < 2:
            # One GPU (e.g. a single real one): kubelet's own count already refuses pods that
            # do not fit, so the split case cannot arise; say so rather than fake it.
            print(f"  only {len(free)} GPU has free slices here, so no request can fit the "
                  "node's free count without fitting one GPU.\n  Run ./scripts/demo "
                  "--simulate-gpus 2 to see the plugin refuse a pod split across GPUs.")
        else:
            ask = min(max(free.values()) + 1, SLICES_PER_GPU)
            split = " + ".join(f"{n} on {gpu_names.get(u, u)}" for u, n in sorted(free.items()))
            print(f"  free slices: {total} ({split}); asking for {ask}")
            show_pod(await kubelet.admit_pod("too-big-d", containers=[("main", ask)]), gpu_names)

        heading("Node after admission")
        print(indent(describe_node(kubelet), "  "))
        records = sorted(paths.allocations_dir(plugin.state_dir).glob("*.json"))
        print(f"\n  {len(records)} allocation records in {paths.allocations_dir(plugin.state_dir)}")
        return 0
    finally:
        code = await plugin.stop()
        await kubelet.stop()
        print(f"\n  plugin stopped (exit status {code})")


PARTS = ("admission", "sharing")


def sharing(root: Path) -> int:
    """The sharing part; a program that fails to start is said in one line, not a traceback."""
    try:
        run_sharing(root, heading)
    except (RuntimeError, OSError, ValueError) as err:
        print(f"  the sharing part failed: {err}", file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    # The docstring's first sentence, whole (it runs over two lines).
    parser = argparse.ArgumentParser(
        description=" ".join((__doc__ or "").split("\n\n")[0].split()) or None)
    parser.add_argument("--simulate-gpus", type=int, default=None,
                        help="use N simulated GPUs (default: real GPUs if NVML finds any, else 2)")
    parser.add_argument("--only", choices=PARTS, default=None,
                        help="run one part: admission (the plugin and kubelet) or sharing (two "
                             "programs on one GPU, live); default both")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory")
    cli.add_version(parser)
    args = parser.parse_args(argv)
    simulate = args.simulate_gpus
    if simulate is None and args.only != "sharing":
        simulate = 0 if nvml_gpu_count() > 0 else 2
    root = Path(tempfile.mkdtemp(prefix="gemini-demo-", dir="/tmp"))
    try:
        code = 0
        if args.only in (None, "admission"):
            code = asyncio.run(run_demo(root, simulate or 0))
        if code == 0 and args.only in (None, "sharing"):
            code = sharing(root)
        return code
    except KeyboardInterrupt:
        return 130
    finally:
        if args.keep:
            print(f"  kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
            print(f"  removed {root}")


if __name__ == "__main__":
    sys.exit(main())
