"""Signals while a server starts: a SIGTERM or SIGINT during the model load ends the process cleanly (exit code 0,
nothing half-written, no speculator process left behind) instead of killing it with 143 (see ``inference.serve``).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import socket
import threading


class Interrupted(BaseException):
    """A SIGTERM or SIGINT while the model loads (raised where the load was; a BaseException, like
    KeyboardInterrupt, so that no ``except Exception`` on the way swallows it)."""


class StartupSignals:
    """SIGTERM and SIGINT from construction until uvicorn takes them over.

    Inside the ``with`` block (the model load) they raise :class:`Interrupted`, so the load unwinds (what was built
    is closed); the speculator processes are killed first, since the signal may be raised as the verifier's join of
    their link returns, and the unwinding would drop the link while a speculator still finishes its side of the
    join (it printed gloo's "Connection closed by peer"). After the block the signal is kept in ``pending`` for the
    server to drain on. Two cases need more:

    - inside :mod:`multiprocessing` (the speculator's spawn writes its pickled arguments to the child) the signal
      is raised ``RETRY_S`` later (a ``SIGALRM``): a child reading a cut pickle would die with a traceback;
    - a main thread blocked in C (waiting for the speculator to join) runs no Python handler: a watcher thread,
      woken by the signal itself (``signal.set_wakeup_fd``), waits ``FORCE_AFTER_S`` for the load to unwind, then
      kills the speculator processes, logs the exit and ends the process with 0 (nothing is being written then).

    Construct it in the main thread; ``log`` receives the forced exit's record.
    """

    RETRY_S = 0.02
    FORCE_AFTER_S = 3.0

    def __init__(self, log: logging.Logger):
        self.log, self.loading, self.pending, self._deferred = log, False, None, None
        self.unwound = threading.Event()  # set once an interrupted load has unwound (the caller's cleanup done)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)
        signal.signal(signal.SIGALRM, self._retry)
        self._wake, wake = socket.socketpair()
        wake.setblocking(False)
        self._wake_writer = wake
        signal.set_wakeup_fd(wake.fileno())
        threading.Thread(target=self._watch, name="startup-signals", daemon=True).start()

    def _handle(self, signum, frame) -> None:
        if not self.loading:
            self.pending = signum
            return
        while frame is not None and "multiprocessing" not in frame.f_code.co_filename:
            frame = frame.f_back
        if frame is not None:
            self._deferred = signum
            signal.setitimer(signal.ITIMER_REAL, self.RETRY_S)
            return
        self.loading, self._deferred = False, None  # (raised once: the unwinding is not interrupted again)
        self._kill_children()  # (before the unwinding drops a link one of them may still be joining)
        raise Interrupted(signal.Signals(signum).name)

    @staticmethod
    def _kill_children() -> None:
        for child in multiprocessing.active_children():
            child.kill()
            child.join(1.0)

    def _retry(self, signum, frame) -> None:
        if self._deferred is not None:
            self._handle(self._deferred, frame)

    def _watch(self) -> None:
        try:
            while data := self._wake.recv(1):
                if data[0] in (signal.SIGTERM, signal.SIGINT) and self.loading is not None:
                    if not self.unwound.wait(self.FORCE_AFTER_S) and self.loading is not None:
                        self._force_exit(signal.Signals(data[0]).name)
        except OSError:  # closed: the server has started
            return

    def _force_exit(self, name: str) -> None:
        self._kill_children()
        self.log.info("exited", extra={"fields": {"event": "exited", "clean": True, "during": "startup",
                                                  "signal": name, "forced": True}})
        logging.shutdown()
        os._exit(0)

    def __enter__(self) -> StartupSignals:
        self.loading = True
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is None:  # loaded: the watcher stands down, and a deferred signal is the server's to drain on
            self.loading = None
            signal.set_wakeup_fd(-1)
            self._wake_writer.close()
            self._wake.close()
        else:
            self.loading = False
        if self._deferred is not None:
            self.pending = self._deferred
