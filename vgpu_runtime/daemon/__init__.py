"""gemini-daemon: the node daemon, the single authority on each allocation's quotas.

One process per node (per state directory). It watches the allocation records, serves one Unix
socket per allocation in that allocation's channel directory, and keeps the memory ledger. The
GPU-time token scheduler plugs into the same sessions (see `channel/session.py`).
"""
