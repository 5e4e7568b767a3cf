"""Generated kubelet API stubs (scripts/gen-protos)."""
