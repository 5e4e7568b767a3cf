"""gemini.ai/vgpu node runtime: the allocation record, the interposer and the node daemon."""

__version__ = "0.4.0"
