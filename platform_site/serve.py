"""The web process's command: ``python -m platform_site.serve APP [uvicorn's options]`` is
uvicorn's own command line, with two changes: its ``--workers N`` parent process, and the
server's housekeeping tick.

The parent holds a copy of the listening socket (to start a worker again if one dies). On
SIGTERM each worker stops accepting and drains (gateway/drain.py), but the socket stays open
through the parent's copy until the workers have exited: a client that connects meanwhile is
queued by the kernel, never accepted, and reset when the parent exits, after it sent its
request (measured by bench/drill_restarts.py: one lost request per client connection at every
restart). Here the parent closes its copy the moment SIGTERM or SIGINT arrives, so a new
connection is refused at once (the client knows nothing was sent) and a retry or the load
balancer goes elsewhere.
"""

from __future__ import annotations

import importlib
import signal
import socket
import sys
from types import FrameType

from uvicorn.config import Config
from uvicorn.supervisors.multiprocess import Multiprocess

from gateway.drain import RestingServer


class ClosingMultiprocess(Multiprocess):
    """uvicorn's worker supervisor, closing its listening sockets on SIGTERM and SIGINT."""

    def __init__(self, config: Config, sockets: list[socket.socket]) -> None:
        super().__init__(config, sockets)
        self.stopping = False
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._stop_listening)

    def _stop_listening(self, sig: int, frame: FrameType | None) -> None:
        self.stopping = True
        for sock in self.sockets:
            sock.close()
        self.signal_queue.append(sig)  # the supervisor's loop then stops the workers

    def keep_subprocess_alive(self) -> None:
        if self.stopping:  # no worker is started again on a closed socket
            return
        super().keep_subprocess_alive()


# How long a thread may hold the GIL while another waits for it (Python's default: 5 ms). The
# event loop shares the interpreter with the prediction log's writer, the metrics fold and the
# database calls of the refresh loop. Paired rounds at 64 connections (bench/README.md, "The
# gateway's own cost"): 1.07x and 1.08x less server CPU per request with 1 ms; p99 unchanged.
SWITCH_INTERVAL_S = 0.001


def main() -> None:
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    # The module, not the package's ``uvicorn.main`` (a name the package rebinds to the function).
    command = importlib.import_module("uvicorn.main")
    command.Multiprocess = ClosingMultiprocess  # type: ignore[attr-defined]
    command.Server = RestingServer  # type: ignore[attr-defined]
    command.main()


if __name__ == "__main__":
    main()
