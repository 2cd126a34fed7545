"""A Ctrl-C that the training loop never loses.

CPython runs a signal's Python handler in the main thread between two bytecodes, wherever that
thread is. If it is inside a finalizer the garbage collector happens to be running (a `__del__`, a
weakref callback), the KeyboardInterrupt the default handler raises there is reported as "Exception
ignored in ..." and dropped: the Ctrl-C is lost and training goes on. CtrlCWatch keeps Python's
behaviour (Ctrl-C raises KeyboardInterrupt at once) and also remembers it, so the loop's
`check()` at each step boundary raises it again if it was dropped.

It takes over SIGINT only where Python's default handler is installed and only from the main
thread; a handler of the caller's own is left alone, and the previous handler is restored on exit.
SIGTERM, where its default action (the process dies on the spot) is installed, is taken over the
same way and ends the run as Ctrl-C does (a KeyboardInterrupt: the end event says `interrupted`,
an async save in flight settles): torchrun sends it to every other rank when one fails, and
schedulers (SLURM, Kubernetes) stop jobs with it.
"""

from __future__ import annotations

import signal
import threading


def stop_signal(signum: int, *args: object) -> KeyboardInterrupt:
    """The KeyboardInterrupt a CtrlCWatch raises, carrying the signal that stopped the run as `.signum` (the CLI
    exits 128 + it)."""
    stop = KeyboardInterrupt(*args)
    stop.signum = signum
    return stop


def stop_description(stop: KeyboardInterrupt) -> str:
    """What stopped the run, in words: the signal a CtrlCWatch named, or Ctrl-C for a bare KeyboardInterrupt
    (Python's own handler, outside the training loop); str(KeyboardInterrupt()) is empty."""
    return str(stop) or "SIGINT (Ctrl-C)"


class CtrlCWatch:
    def __init__(self) -> None:
        self.pressed = False
        self._reason = ""
        self._signum = signal.SIGINT
        self._previous: dict[int, object] = {}

    def __enter__(self) -> CtrlCWatch:
        self.pressed = False
        if threading.current_thread() is threading.main_thread():
            if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
                self._previous[signal.SIGINT] = signal.signal(signal.SIGINT, self._on_signal)
            if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
                self._previous[signal.SIGTERM] = signal.signal(signal.SIGTERM, self._on_signal)
        return self

    def _on_signal(self, signum, frame) -> None:
        self.pressed = True
        self._signum = signum
        if signum == signal.SIGINT:
            self._reason = "Ctrl-C"
            raise stop_signal(signum, "SIGINT (Ctrl-C)")
        self._reason = "SIGTERM"
        raise stop_signal(signum, "SIGTERM: the job was told to stop (torchrun after another rank failed, or a scheduler)")

    def check(self) -> None:
        """Raise KeyboardInterrupt if Ctrl-C (or SIGTERM) came: reached only when the first one was dropped."""
        if self.pressed:
            raise stop_signal(self._signum, f"{self._reason}, raised again at a step boundary (the first KeyboardInterrupt "
                                    "landed in a finalizer run by the garbage collector, which CPython drops)")

    def __exit__(self, exc_type, exc, tb) -> bool:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()
        self.pressed = False
        return False
