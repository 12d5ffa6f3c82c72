"""serve's logs: one line per event on stderr, as text or as JSON objects.

Loggers, each line carrying its fields as `extra`:
- checkoutcache.access  one line per request: method, endpoint, status, ms,
                        token (its name: a digest, never the token), scopes,
                        what it was about (repo without credentials, commit),
                        the answer's state, error; refused tokens and origins
                        say why. Probes and scrapes that succeed are debug
                        lines (one every few seconds from each kubelet and
                        Prometheus), every other request an INFO one.
- checkoutcache.events  clones started / published / failed / died, seeding,
                        gc summaries.
- checkoutcache.serve   the server's own (start: version and the limits in force;
                        stop; a failing gc; tokens reloaded).

A client's bad input is an access line with its error code, never a traceback;
only a bug (INTERNAL_ERROR) logs one.

Writing never blocks the event loop: records go through a bounded queue to a
thread that writes them (a stderr nobody reads, a full pipe, would otherwise
stop every answer). When the queue is full, lines are dropped and counted, and
the count is said once the writer catches up. Access lines, one per request,
take a shorter way to the same writer (`access()`: a tuple on a deque, no
LogRecord, no lock), formatted there like every other line: at thousands of
requests a second, logging's machinery cost more than the answer.
"""

from __future__ import annotations

import collections
import json
import logging
import logging.handlers
import queue
import sys
import threading
import time

LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}
# A record's own attributes; any other is an event field given as `extra`.
STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime", "taskName"}


def _fields(record: logging.LogRecord) -> dict:
    return {k: v for k, v in record.__dict__.items() if k not in STANDARD}


class TextFormatter(logging.Formatter):
    """Text lines, with the event's fields after the message as key=value."""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        fields = _fields(record)
        if fields:
            text += " " + " ".join(f"{k}={v}" for k, v in fields.items())
        return text


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time (UTC, ISO 8601), level, logger, message, then the
    event's fields. (python-json-logger's formatter was measured at twice the cost, on a
    path that runs once per request.)"""

    def format(self, record: logging.LogRecord) -> str:
        line = {"time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
                + f".{int(record.msecs):03d}Z", "level": record.levelname, "logger": record.name,
                "message": record.getMessage(), **_fields(record)}
        if record.exc_info:
            line["traceback"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


class QuietGranian(logging.Filter):
    """granian's embedded mode warns that it is experimental, once per listener at every
    start: we pinned the version and test it (serve/server.py); the warning says nothing more."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "experimental" not in record.getMessage()


QUEUE_LINES = 10_000
WRITE_EVERY = 0.05  # the writer wakes this often and writes what came, in one write


class DroppingQueueHandler(logging.handlers.QueueHandler):
    """Hands records to the writer thread as they are (formatted there, not on the
    event loop); drops them (counting) rather than wait when the queue is full."""

    def __init__(self, records: queue.Queue):
        super().__init__(records)
        self.dropped = 0

    def prepare(self, record: logging.LogRecord) -> logging.LogRecord:
        return record  # one process: nothing to pickle, so no formatting here

    def enqueue(self, record: logging.LogRecord) -> None:
        try:
            if self.dropped and self.queue.qsize() < QUEUE_LINES // 2:
                dropped, self.dropped = self.dropped, 0
                self.queue.put_nowait(logging.makeLogRecord({
                    "name": "checkoutcache.serve", "levelno": logging.WARNING, "levelname": "WARNING",
                    "msg": "%d log lines were dropped: the log's reader fell behind", "args": (dropped,)}))
            self.queue.put_nowait(record)
        except queue.Full:
            self.dropped += 1


ACCESS = "checkoutcache.access"
_ACCESS_LINES: collections.deque = collections.deque(maxlen=QUEUE_LINES)
_ACCESS_LEVEL = logging.CRITICAL + 1  # none until configured


def access_enabled(debug: bool = False) -> bool:
    """Whether an access line of that level (debug, else INFO) is written."""
    return _ACCESS_LEVEL <= (logging.DEBUG if debug else logging.INFO)


def access(message: str, fields: dict, debug: bool = False) -> None:
    """One access line (logger checkoutcache.access, level INFO or DEBUG), formatted by the writer."""
    _ACCESS_LINES.append((time.time(), message, fields, debug))


class BatchWriter(threading.Thread):
    """Formats and writes queued records in batches: one write per batch, not per line."""

    def __init__(self, records: queue.Queue, formatter: logging.Formatter, stream):
        super().__init__(name="cc-log-writer", daemon=True)
        self.records, self.formatter, self.stream = records, formatter, stream
        self.filters = [QuietGranian()]
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.wait(WRITE_EVERY):
            self.drain()
        self.drain()

    def drain(self) -> None:
        lines = []
        while _ACCESS_LINES:
            created, message, fields, debug = _ACCESS_LINES.popleft()
            record = logging.makeLogRecord({"name": ACCESS, "levelno": logging.DEBUG if debug else logging.INFO,
                                            "levelname": "DEBUG" if debug else "INFO",
                                            "msg": message, "created": created,
                                            "msecs": (created - int(created)) * 1000})
            record.__dict__.update(fields)
            lines.append(self.formatter.format(record))
        while True:
            try:
                record = self.records.get_nowait()
            except queue.Empty:
                break
            if all(f.filter(record) for f in self.filters):
                try:
                    lines.append(self.formatter.format(record))
                except Exception:  # a record that cannot be formatted is skipped, never the writer
                    continue
        if lines:
            try:
                self.stream.write("\n".join(lines) + "\n")
                self.stream.flush()
            except (OSError, ValueError):
                pass

    def stop(self) -> None:
        self.stopping.set()
        self.join(2)


_WRITER: BatchWriter | None = None


def configure(log_format: str, log_level: str) -> None:
    """serve's records on stderr for every checkoutcache logger (granian's included),
    formatted and written by a thread of its own."""
    global _WRITER, _ACCESS_LEVEL
    _ACCESS_LEVEL = LEVELS[log_level]
    if log_format == "json":
        formatter: logging.Formatter = JsonFormatter()
    else:
        formatter = TextFormatter("%(asctime)s %(levelname)s %(name)s %(message)s")
    records: queue.Queue = queue.Queue(QUEUE_LINES)
    if _WRITER is not None:
        _WRITER.stop()
    _WRITER = BatchWriter(records, formatter, sys.stderr)
    _WRITER.start()
    queued = DroppingQueueHandler(records)
    for name in ("checkoutcache", "granian", "_granian"):
        logger = logging.getLogger(name)
        logger.handlers[:] = [queued]
        logger.propagate = False
        logger.setLevel(LEVELS[log_level] if name == "checkoutcache" else max(LEVELS[log_level], logging.WARNING))


def flush() -> None:
    """Write what is queued (at exit: serve leaves with os._exit)."""
    if _WRITER is not None:
        _WRITER.stop()
