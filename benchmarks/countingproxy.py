"""A TCP proxy in front of an upstream on 127.0.0.1 that counts what the upstream
sends: bytes per connection, and the object count of every pack in a git
upload-pack response (read from the pack headers as the response streams).
Shared by the benchmarks that count at the upstream (fidelity.py, fleet.py).
"""

from __future__ import annotations

import socket
import threading
import time

HEX = frozenset(b"0123456789abcdefABCDEF")


class PackHeaders:
    """The object counts of the packs in one upload-pack response (upstream to client), fed as it streams.

    The response is pkt-lines (4 hex digits of length, then the payload; 0000, 0001 and 0002 are flush,
    delim and response-end). A pack travels in side-band pkt-lines whose first payload byte is the channel
    (1 pack data, 2 progress, 3 error), after "packfile" (v2) or the negotiation's ACK/NAK (v0/v1); its
    first 12 bytes are "PACK", the version and the object count (big-endian). A side-band run ends at a
    flush, so one connection may carry several packs. Without side-band the pack follows the NAK raw.
    Payloads are never buffered: only the 4 length digits and a pack's first 12 bytes are kept.
    """

    def __init__(self) -> None:
        self.counts: list[int] = []
        self.unparsed = False  # the stream was not what the protocol says: its counts are incomplete
        self._length = bytearray()  # the next pkt-line's length digits, while incomplete
        self._left = 0  # payload bytes of the current pkt-line still to come
        self._first = False  # the next payload byte is the current pkt-line's first (the side-band channel)
        self._pack_data = False  # the current pkt-line carries pack data (side-band channel 1)
        self._pack_started = False  # this side-band run's pack has begun: later channel-1 bytes are its body
        self._header: bytearray | None = None  # the current pack's first bytes, until all 12 are read
        self._raw = False  # a pack without side-band: everything after its header is pack data

    def feed(self, data: bytes) -> None:
        i, end = 0, len(data)
        while i < end and not self.unparsed:
            if self._raw:
                if self._header is not None:
                    i = self._read_header(data, i, end)
                return
            if self._left:
                if self._first:
                    self._first = False
                    self._start_payload(data[i])
                    i += 1
                    self._left -= 1
                    continue
                take = min(self._left, end - i)
                if self._pack_data and self._header is not None:
                    self._read_header(data, i, i + take)
                i += take
                self._left -= take
                continue
            take = min(4 - len(self._length), end - i)
            self._length += data[i:i + take]
            i += take
            if len(self._length) == 4:
                self._start_pkt_line(bytes(self._length))
                self._length.clear()

    def _start_pkt_line(self, digits: bytes) -> None:
        if digits == b"PACK":  # no side-band: the pack itself, where a pkt-line would start
            self._raw, self._header = True, bytearray(digits)
            return
        if not set(digits) <= HEX:
            self.unparsed = True
            return
        length = int(digits, 16)
        if length < 4:  # flush, delim, response-end: the end of a side-band run
            self._pack_data = self._pack_started = False
            if length == 3:
                self.unparsed = True
        elif length > 4:
            self._left, self._first = length - 4, True

    def _start_payload(self, channel: int) -> None:
        if channel == 1:
            self._pack_data = True
            if not self._pack_started:  # a new pack: read its header
                self._pack_started, self._header = True, bytearray()
        elif channel in (2, 3):  # progress or an error inside the run: the pack goes on after it
            self._pack_data = False
        else:  # a plain line (a ref, ACK, NAK, "packfile"): not pack data
            self._pack_data = self._pack_started = False

    def _read_header(self, data: bytes, start: int, stop: int) -> int:
        take = min(12 - len(self._header), stop - start)
        self._header += data[start:start + take]
        if len(self._header) == 12:
            if self._header.startswith(b"PACK"):
                self.counts.append(int.from_bytes(self._header[8:12], "big"))
            else:
                self.unparsed = True
            self._header = None
        return start + take


class Connection:
    def __init__(self, label: str):
        self.label = label
        self.to_client = 0
        self.to_upstream = 0
        self.packs = PackHeaders()
        self.open = True


class CountingProxy:
    """A TCP proxy on 127.0.0.1 to the upstream's port: per connection, the bytes the upstream sent and
    the object counts of the packs in them. Every connection is tagged with the label current when it
    was accepted (the benchmark's phase), so one proxy serves every phase."""

    def __init__(self, target: int, name: str = "proxy"):
        self.target, self.name = target, name
        self.label = "idle"
        self.connections: list[Connection] = []
        self.lock = threading.Lock()
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True, name=f"proxy-{name}").start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target))
            except OSError:
                client.close()
                continue
            with self.lock:
                conn = Connection(self.label)
                self.connections.append(conn)
            ends = [2]  # both directions must finish before the sockets are closed
            for src, dst, down in ((client, upstream, False), (upstream, client, True)):
                threading.Thread(target=self._pipe, args=(conn, src, dst, down, ends, client, upstream),
                                 daemon=True).start()

    def _pipe(self, conn: Connection, src: socket.socket, dst: socket.socket, down: bool, ends: list[int],
              client: socket.socket, upstream: socket.socket) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                dst.sendall(data)
                with self.lock:
                    if down:
                        conn.to_client += len(data)
                        conn.packs.feed(data)
                    else:
                        conn.to_upstream += len(data)
        except OSError:
            pass
        finally:
            try:
                dst.shutdown(socket.SHUT_WR)
            except OSError:
                pass
            with self.lock:
                ends[0] -= 1
                last = ends[0] == 0
                if last:
                    conn.open = False
            if last:
                client.close()
                upstream.close()

    def tally(self, label: str) -> dict:
        """Totals of the connections accepted under the label."""
        with self.lock:
            conns = [c for c in self.connections if c.label == label]
            packs = [n for c in conns for n in c.packs.counts]
            return {"connections": len(conns), "bytes": sum(c.to_client for c in conns),
                    "bytes_to_upstream": sum(c.to_upstream for c in conns), "objects": sum(packs),
                    "packs": packs, "unparsed": sum(c.packs.unparsed for c in conns),
                    "still_open": sum(c.open for c in conns)}

    def read(self) -> int:
        """Bytes the upstream has sent over every connection so far."""
        with self.lock:
            return sum(c.to_client for c in self.connections)

    def wait_idle(self, timeout: float = 10.0) -> None:
        """Until every connection has closed: the last bytes of a response are counted by then."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                if not any(c.open for c in self.connections):
                    return
            time.sleep(0.02)

    def stop(self) -> None:
        try:  # shutdown wakes the accepting thread; a bare close would leave it in accept()
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
