"""How fast one allocation may open connections, and what the log says about them (a
client reconnecting in a loop made the daemon log three lines per attempt, 1.25 MB/s, and
cost other tenants milliseconds of token latency).

Per allocation, a token bucket on accept: `connect_burst` connections at once, then
`connect_rate` per second. A connection past it is refused on accept with an error frame
(GM_ERR_OVER_LIMIT, naming the setting) before any session exists; the hook's reconnect
backoff (10 ms doubling to 500 ms) finds room again within a fraction of a second. A container
that starts many processes at once fits in the burst.

The log: the first `LOGGED_PER_WINDOW` connections, and as many refusals, of an allocation in
each 10 s window are logged one by one, as before; past that they are counted, and one line
says "N connections in the last 10 s" with how many were refused, at the end of the window.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

WINDOW_SECONDS = 10.0
LOGGED_PER_WINDOW = 10


class ConnectMeter:
    def __init__(self, rate: float, burst: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.rate, self.burst, self.clock = rate, burst, clock
        self.tokens = float(burst)
        self.refilled_at = clock()
        self.window_start = self.refilled_at
        self.connections = self.refused = self.unlogged = 0
        self.logged = {False: 0, True: 0}   # connections served, refusals
        self.refused_total = 0

    def admit(self) -> bool:
        """One connection arrives: True to serve it, False to refuse it (rate 0: no limit)."""
        now = self.clock()
        self.connections += 1
        if self.rate <= 0:
            return True
        self.tokens = min(float(self.burst), self.tokens + (now - self.refilled_at) * self.rate)
        self.refilled_at = now
        if self.tokens >= 1:
            self.tokens -= 1
            return True
        self.refused += 1
        self.refused_total += 1
        return False

    def log_level(self, refused: bool = False) -> int:
        """INFO for a connection (or a refusal) still logged one by one in this window, else
        DEBUG: it is in the window's summary."""
        if self.logged[refused] < LOGGED_PER_WINDOW:
            self.logged[refused] += 1
            return logging.INFO
        self.unlogged += 1
        return logging.DEBUG

    @property
    def summarising(self) -> bool:
        """Some connection of this window is told only in its summary."""
        return self.unlogged > 0

    def window_over(self) -> bool:
        return self.clock() - self.window_start >= WINDOW_SECONDS

    def close_window(self) -> str | None:
        """Ends the window: its summary if some of it went unlogged, else None."""
        summary = None
        if self.summarising:
            seconds = max(self.clock() - self.window_start, WINDOW_SECONDS)
            summary = (f"{self.connections} connections in the last {seconds:.0f} s, "
                       f"{self.refused} refused (connect_rate), "
                       f"{self.unlogged} not logged one by one")
        self.window_start = self.clock()
        self.connections = self.refused = self.unlogged = 0
        self.logged = {False: 0, True: 0}
        return summary
