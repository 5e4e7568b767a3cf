"""A stand-in for kubelet's device manager, for tests, the demo and the benchmark.

It follows kubelet's published behaviour (its device plugin and PodResources APIs): a
Registration server on <dir>/kubelet.sock that dials the plugin back inside Register, one
ListAndWatch stream per resource, kubelet's device selection and per-container Allocate, a
restart that wipes the socket directory, and a PodResources server.
"""

from vgpu_runtime.devkit.kubelet_emulator.describe import describe_node
from vgpu_runtime.devkit.kubelet_emulator.emulator import KubeletEmulator
from vgpu_runtime.devkit.kubelet_emulator.pods import ContainerAllocation, Pod

__all__ = ["ContainerAllocation", "KubeletEmulator", "Pod", "describe_node"]
