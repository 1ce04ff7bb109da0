"""SGLang's ``--watchdog-timeout``: a scheduler iteration (admission, prefill, a decode step) that has not finished
after ``timeout`` seconds means a hung device or a deadlock; the watchdog then logs it, prints every thread's stack
and ends the process with exit code 1, so that whatever supervises the server (systemd, Kubernetes) restarts it
instead of leaving it hung with its clients waiting. Control calls run between iterations (warmup compiles, weight
loads) and a paused server are not timed."""

from __future__ import annotations

import faulthandler
import logging
import os
import sys
import threading
import time
from typing import Callable

log = logging.getLogger("specjax.serve")


def end_process() -> None:
    """The default reaction: every thread's stack to stderr, then exit code 1 at once (a hung device call would
    block a normal exit)."""
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    sys.stderr.flush()
    os._exit(1)


class Watchdog:
    def __init__(self, timeout: float, on_hang: Callable[[], None] = end_process):
        self.timeout, self.on_hang = timeout, on_hang
        self._since: float | None = None  # when the iteration now running began (None: none is)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="specjax-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def begin(self) -> None:
        """An iteration starts (the scheduler thread)."""
        self._since = time.monotonic()

    def end(self) -> None:
        self._since = None

    def _watch(self) -> None:
        while not self._stop.wait(min(self.timeout / 4, 5.0)):
            since = self._since
            if since is not None and time.monotonic() - since > self.timeout:
                log.error("watchdog: a scheduler iteration has run for over %.0f s (--watchdog-timeout): the "
                          "device or the scheduler is hung; ending the process", self.timeout)
                self._stop.set()
                self.on_hang()
