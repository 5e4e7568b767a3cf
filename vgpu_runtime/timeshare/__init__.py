"""Time-sharing, the algorithm: who holds a GPU's time token next, and for how long.

Pure and synchronous: every call takes the current time, so the node daemon drives it from
asyncio timers and the tests drive it from a fake clock. One TokenScheduler per GPU.
"""
