"""A small fake Kubernetes API server: just the calls gemini-daemon makes."""

from vgpu_runtime.devkit.fakeapi.server import FakeApiServer, describe_node

__all__ = ["FakeApiServer", "describe_node"]
