"""A TCP proxy with a gate, in front of a real server (git daemon): while the
gate is shut, connections are accepted and their bytes held (nothing reaches
the server), so a clone is stuck in its fetch for as long as a test needs,
whatever the machine's speed; opening the gate lets every held connection
through. `held` counts connections that met the shut gate, so a test knows
a fetch has begun without sleeping."""

from __future__ import annotations

import socket
import threading


def shut(*ends: socket.socket) -> None:
    """Both directions of each socket ended (the other side sees the close at once)."""
    for end in ends:
        try:
            end.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


class GatedProxy:
    def __init__(self, target_port: int, host: str = "127.0.0.1"):
        self.target = (host, target_port)
        self.server = socket.socket()
        self.server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.server.bind((host, 0))
        self.server.listen(64)
        self.port = self.server.getsockname()[1]
        self.held = 0
        self._open = threading.Event()
        self._open.set()
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def url(self, name: str) -> str:
        return f"git://{self.target[0]}:{self.port}/{name}"

    def shut(self) -> None:
        self._open.clear()

    def open(self) -> None:
        self._open.set()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            with self._lock:
                self._sockets.append(client)
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        if not self._open.is_set():
            with self._lock:
                self.held += 1
            self._open.wait()
        upstream = self._connect(client)
        if upstream is None:
            return
        threading.Thread(target=self._pump_down, args=(upstream, client), daemon=True).start()
        self._pump(client, upstream)

    def _connect(self, client: socket.socket) -> socket.socket | None:
        """A connection to the server for this client (closed with the proxy), or None (the
        client closed: the server is gone)."""
        try:
            upstream = socket.create_connection(self.target)
        except OSError:
            client.close()
            return None
        with self._lock:
            self._sockets.append(upstream)
        return upstream

    def _pump_down(self, source: socket.socket, sink: socket.socket) -> None:
        """The server's bytes to the client."""
        self._pump(source, sink)

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            shut(source, sink)

    def close(self) -> None:
        self._open.set()
        self.server.close()
        with self._lock:
            for sock in self._sockets:
                sock.close()


class PackTailProxy(GatedProxy):
    """A proxy in front of git daemon that hands the client a fetch's whole pack but holds
    back the flush packet that ends the response (protocol v2), for as long as the test
    needs: the client's index-pack has written the pack and its `.keep`, and its fetch
    waits for the end of the response before it updates refs and removes the `.keep`."""

    FLUSH = b"0000"

    def __init__(self, target_port: int, host: str = "127.0.0.1"):
        super().__init__(target_port, host)
        self._tail_open = threading.Event()
        self._tail_open.set()
        self.tails_held = 0

    def hold_tails(self) -> None:
        self._tail_open.clear()

    def release_tails(self) -> None:
        """The held ends go on: each waiting fetch finishes (updates its refs, removes its `.keep`)."""
        self._tail_open.set()

    def close(self) -> None:
        self._tail_open.set()
        super().close()

    def _pump_down(self, source: socket.socket, sink: socket.socket) -> None:
        seen_pack = False
        try:
            while data := source.recv(65536):
                seen_pack = seen_pack or b"packfile\n" in data
                if seen_pack and data.endswith(self.FLUSH) and not self._tail_open.is_set():
                    sink.sendall(data[:-len(self.FLUSH)])
                    with self._lock:
                        self.tails_held += 1
                    self._tail_open.wait()  # the client waits for the end of the response meanwhile
                    data = self.FLUSH
                sink.sendall(data)
        except OSError:
            pass
        finally:
            shut(source, sink)


class RequestGate(GatedProxy):
    """A proxy in front of git daemon that holds the server's answer to each request whose bytes
    hold `pattern` (b"deepen ": a shallow fetch's) while the gate is shut, letting every other
    request through: one fetch waits at a known point for as long as the test needs while others
    run. `held` counts the answers held."""

    def __init__(self, target_port: int, pattern: bytes, host: str = "127.0.0.1"):
        super().__init__(target_port, host)
        self.pattern = pattern

    def _serve(self, client: socket.socket) -> None:
        upstream = self._connect(client)
        if upstream is None:
            return
        state = {"seen": b"", "matched": False}
        threading.Thread(target=self._answers, args=(upstream, client, state), daemon=True).start()
        try:
            while data := client.recv(65536):
                state["seen"] = (state["seen"] + data)[-65536:]
                state["matched"] = state["matched"] or self.pattern in state["seen"]
                upstream.sendall(data)
        except OSError:
            pass
        finally:
            shut(client, upstream)

    def _answers(self, upstream: socket.socket, client: socket.socket, state: dict) -> None:
        counted = False
        try:
            while data := upstream.recv(65536):
                if state["matched"] and not self._open.is_set():
                    if not counted:
                        counted = True
                        with self._lock:
                            self.held += 1
                    self._open.wait()
                client.sendall(data)
        except OSError:
            pass
        finally:
            shut(upstream, client)
