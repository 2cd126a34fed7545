"""A Ctrl-C that the training loop never loses.

CPython runs a signal's Python handler in the main thread between two bytecodes, wherever that
thread is. If it is inside a finalizer the garbage collector happens to be running (a `__del__`, a
weakref callback), the KeyboardInterrupt the default handler raises there is reported as "Exception
ignored in ..." and dropped: the Ctrl-C is lost and training goes on. CtrlCWatch keeps Python's
behaviour (Ctrl-C raises KeyboardInterrupt at once) and also remembers it, so the loop's
`check()` at each step boundary raises it again if it was dropped.

It takes over SIGINT only where Python's default handler is installed and only from the main
thread; a handler of the caller's own is left alone, and the previous handler is restored on exit.
"""

from __future__ import annotations

import signal
import threading


class CtrlCWatch:
    def __init__(self) -> None:
        self.pressed = False
        self._previous = None

    def __enter__(self) -> CtrlCWatch:
        self.pressed = False
        if (threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGINT) is signal.default_int_handler):
            self._previous = signal.signal(signal.SIGINT, self._on_sigint)
        return self

    def _on_sigint(self, signum, frame) -> None:
        self.pressed = True
        raise KeyboardInterrupt

    def check(self) -> None:
        """Raise KeyboardInterrupt if Ctrl-C was pressed: reached only when the first one was dropped."""
        if self.pressed:
            raise KeyboardInterrupt("Ctrl-C, raised again at a step boundary (the first KeyboardInterrupt "
                                    "landed in a finalizer run by the garbage collector, which CPython drops)")

    def __exit__(self, exc_type, exc, tb) -> bool:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None
        self.pressed = False
        return False
