"""The generated kubelet API modules under short names, and the constants kubelet uses."""

from __future__ import annotations

from typing import Any

from vgpu_runtime.kubeletapi.deviceplugin.v1beta1 import api_pb2 as dp
from vgpu_runtime.kubeletapi.deviceplugin.v1beta1 import api_pb2_grpc as _dp_grpc
from vgpu_runtime.kubeletapi.podresources.v1 import api_pb2 as pr
from vgpu_runtime.kubeletapi.podresources.v1 import api_pb2_grpc as _pr_grpc

# The generated service modules carry no type hints; seen as Any so strict mypy accepts them.
dp_grpc: Any = _dp_grpc
pr_grpc: Any = _pr_grpc

API_VERSION = "v1beta1"
KUBELET_SOCKET = "kubelet.sock"
CHECKPOINT_FILE = "kubelet_internal_checkpoint"
HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"
# Kubelet dials a registering plugin back with a blocking dial bounded by this.
DIAL_TIMEOUT_S = 10.0
ADMISSION_ERROR_REASON = "UnexpectedAdmissionError"
# What a rejected pod's status message starts with (the Event has the rest alone).
REJECTED_PREFIX = "Pod was rejected: "

__all__ = ["dp", "dp_grpc", "pr", "pr_grpc"]
