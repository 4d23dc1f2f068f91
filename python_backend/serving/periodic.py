"""A function called every few tenths of a second on a thread of its own, for the watchers that outlive requests
(heartbeats, the cancellation watch, the llm watchdog)."""

from __future__ import annotations

import threading
from typing import Callable


class Periodic:
    """Calls ``tick()`` every ``interval_s`` on a daemon thread until ``stop()``. A tick that raises is reported and
    the next one runs: a watcher must outlive one failure."""

    def __init__(self, name: str, interval_s: float, tick: Callable[[], None]):
        self.name, self.interval_s, self.tick = name, interval_s, tick
        self._stopped = threading.Event()

    def start(self) -> None:
        def loop():
            while not self._stopped.wait(self.interval_s):
                try:
                    self.tick()
                except Exception as error:  # noqa: BLE001
                    print(f"[{self.name}] {type(error).__name__}: {error}", flush=True)

        threading.Thread(target=loop, name=self.name, daemon=True).start()

    def stop(self) -> None:
        self._stopped.set()
