"""Catching the signals a scheduler sends before it stops a job (SIGTERM, SIGINT, SIGUSR1)."""

from __future__ import annotations

import signal
import threading
from typing import Any, Callable, Iterable

DEFAULT_PREEMPTION_SIGNALS = tuple(
    getattr(signal, name) for name in ("SIGTERM", "SIGINT", "SIGUSR1") if hasattr(signal, name)
)


class SignalCatcher:
    """Calls ``on_signal(signal_number)`` for each of ``signals``, instead of their usual handlers.

    The handler only records the request, so it is safe at any point of the program. A second SIGINT
    (Ctrl-C twice) restores the usual handlers and raises ``KeyboardInterrupt`` at once.
    """

    def __init__(self, signals: Iterable[int], on_signal: Callable[[int], None]):
        self.signals = tuple(signals)
        self.on_signal = on_signal
        self.received: list[int] = []
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        """Take over the signals; a no-op outside the main thread, where Python cannot set handlers."""
        if threading.current_thread() is not threading.main_thread():
            return
        for signal_number in self.signals:
            self._previous[signal_number] = signal.signal(signal_number, self._handle)

    def uninstall(self) -> None:
        """Give the signals back to the handlers they had before :meth:`install`."""
        previous, self._previous = self._previous, {}
        for signal_number, handler in previous.items():
            signal.signal(signal_number, handler)

    def _handle(self, signal_number: int, frame) -> None:
        if signal_number == signal.SIGINT and signal.SIGINT in self.received:
            self.uninstall()
            raise KeyboardInterrupt  # exits at once; an unfinished save is only a temporary folder
        self.received.append(signal_number)
        self.on_signal(signal_number)
