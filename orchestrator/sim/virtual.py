"""An asyncio event loop on a virtual clock: `await asyncio.sleep(0.2)` takes no time, the clock jumps to the next
timer when every task waits. The scheduler runs on it unchanged (it reads time only through the clock it is given
and asyncio's timers), so a simulated hour of serving takes seconds.

    clock = VirtualClock()
    result = run_virtual(main(clock), clock)   # main sleeps; clock.now advances by what it slept

A loop that waits with no timer pending would wait forever in real life: here it raises `Stalled` (a hang is a
bug the simulation reports instead of hiding).
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Coroutine


class Stalled(RuntimeError):
    """Every task waits and no timer is pending: in a real run, a hang."""


class VirtualClock:
    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class _Selector(selectors.SelectSelector):
    """Registers like a select() selector (the loop's self-pipe), but never blocks: a wait advances the clock."""

    def __init__(self, clock: VirtualClock) -> None:
        super().__init__()
        self.clock = clock

    def select(self, timeout: float | None = None):
        if timeout is None:
            raise Stalled("every task waits and no timer is pending (a real run would hang here)")
        if timeout > 0:
            self.clock.now += timeout
        return []


class VirtualLoop(asyncio.SelectorEventLoop):
    """No I/O and no threads: only tasks, futures and timers."""

    def __init__(self, clock: VirtualClock) -> None:
        super().__init__(_Selector(clock))
        self.clock = clock

    def time(self) -> float:
        return self.clock.now


def run_virtual(main: Coroutine, clock: VirtualClock):
    """Run `main` to completion on a virtual loop (like asyncio.run, tasks left over are cancelled)."""
    loop = VirtualLoop(clock)
    try:
        return loop.run_until_complete(main)
    finally:
        tasks = [t for t in asyncio.all_tasks(loop) if not t.done()]
        for t in tasks:
            t.cancel()
        if tasks:
            loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
        loop.close()
