"""A TCP forwarder a test controls, standing between one cache and the shared PostgreSQL server.

Stopping it closes its port and every connection through it, so the cache behind it meets what a
node meets when the server goes away (connections reset, new ones refused) while the server,
which other tests and engineers share, keeps running. Starting it again on the same port is the
server coming back.

The faults an operator's network produces, one method each: :meth:`cut` resets every open
connection (new ones go through), :meth:`refuse` is :meth:`stop` (open ones reset, new ones
refused) and :meth:`stall` holds every connection, open or new, silent: connected, but no byte
passes either way, as behind a partition that drops packets. :meth:`heal` ends any of them.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading


class TcpProxy:
    """Forwards 127.0.0.1:``port`` to ``target`` while started."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.port = 0
        self._listener: socket.socket | None = None
        self._sockets: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._flowing = threading.Event()
        self._flowing.set()

    def start(self) -> None:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))  # the same port again after a stop
        listener.listen(64)
        self.port = listener.getsockname()[1]
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def stop(self) -> None:
        """Refuse new connections and reset the open ones."""
        listener, self._listener = self._listener, None
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)
            listener.close()
        with self._lock:
            open_sockets, self._sockets = self._sockets, set()
        for each in open_sockets:
            with contextlib.suppress(OSError):
                each.shutdown(socket.SHUT_RDWR)
            each.close()

    def cut(self) -> None:
        """Reset every open connection (RST, as a middlebox that dropped them); new ones pass."""
        with self._lock:
            open_sockets, self._sockets = self._sockets, set()
        for each in open_sockets:
            with contextlib.suppress(OSError):
                each.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                each.shutdown(socket.SHUT_RD)  # wakes its pump; sends nothing
            each.close()  # lingering 0 s: a reset

    def refuse(self) -> None:
        """New connections are refused and open ones reset, until :meth:`heal`."""
        self.stop()

    def stall(self) -> None:
        """Every connection, open or new, stays connected but silent until :meth:`heal`."""
        self._flowing.clear()

    def heal(self) -> None:
        """End the fault: bytes flow again; a refusing proxy listens again (same port)."""
        self._flowing.set()
        if self._listener is None:
            self.start()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # stopped
            try:
                server = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._sockets.update((client, server))
            for source, sink in ((client, server), (server, client)):
                threading.Thread(
                    target=_pump, args=(source, sink, self._flowing), daemon=True
                ).start()


def _pump(source: socket.socket, sink: socket.socket, flowing: threading.Event) -> None:
    """Forward ``source`` to ``sink``; while stalled (``flowing`` clear), hold what arrives (the
    kernel buffers the rest), so neither side hears anything."""
    try:
        while data := source.recv(65536):
            flowing.wait()
            sink.sendall(data)
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_RDWR)
