"""A container's channel: its socket and sessions, the memory ledger and the GPU-time tokens."""
