"""serve's logs: one line per event on stderr, as text or as JSON objects
(python-json-logger's formatter: escaping and types done right).

Loggers, each line carrying its fields as `extra`:
- checkoutcache.access  one line per request: method, endpoint, status, ms,
                        token (its name: a digest, never the token), scopes,
                        error; refused tokens and origins say why.
- checkoutcache.events  clones started / published / failed / died, seeding,
                        gc summaries.
- checkoutcache.serve   the server's own (start, stop, a failing gc).

A client's bad input is an access line with its error code, never a traceback;
only a bug (INTERNAL_ERROR) logs one.

Writing never blocks the event loop: records go through a bounded queue to a
thread that writes them (a stderr nobody reads, a full pipe, would otherwise
stop every answer). When the queue is full, lines are dropped and counted, and
the count is said once the writer catches up.
"""

from __future__ import annotations

import logging
import logging.handlers
import queue
import sys

from pythonjsonlogger.json import JsonFormatter

LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}
# What every JSON line has, in this order; the `extra` fields follow.
JSON_FIELDS = ["asctime", "levelname", "name", "message"]


class TextFormatter(logging.Formatter):
    """Text lines, with the event's fields after the message as key=value."""

    STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime", "taskName"}

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        fields = {k: v for k, v in vars(record).items() if k not in self.STANDARD}
        if fields:
            text += " " + " ".join(f"{k}={v}" for k, v in fields.items())
        return text


class QuietGranian(logging.Filter):
    """granian's embedded mode warns that it is experimental, once per listener at every
    start: we pinned the version and test it (serve/server.py); the warning says nothing more."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "experimental" not in record.getMessage()


QUEUE_LINES = 10_000


class DroppingQueueHandler(logging.handlers.QueueHandler):
    """Hands records to the writer thread; drops them (counting) rather than wait."""

    def __init__(self, records: queue.Queue):
        super().__init__(records)
        self.dropped = 0

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


_LISTENER: logging.handlers.QueueListener | None = None


def configure(log_format: str, log_level: str) -> None:
    """serve's handler on stderr for every checkoutcache logger (granian's included),
    written by a thread of its own."""
    global _LISTENER
    handler = logging.StreamHandler(sys.stderr)
    if log_format == "json":
        handler.setFormatter(JsonFormatter(JSON_FIELDS, rename_fields={"levelname": "level", "name": "logger",
                                                                       "asctime": "time"}))
    else:
        handler.setFormatter(TextFormatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    handler.addFilter(QuietGranian())
    records: queue.Queue = queue.Queue(QUEUE_LINES)
    if _LISTENER is not None:
        _LISTENER.stop()
    _LISTENER = logging.handlers.QueueListener(records, handler, respect_handler_level=True)
    _LISTENER.start()
    queued = DroppingQueueHandler(records)
    for name in ("checkoutcache", "granian", "_granian"):
        logger = logging.getLogger(name)
        logger.handlers[:] = [queued]
        logger.propagate = False
        logger.setLevel(LEVELS[log_level] if name == "checkoutcache" else max(LEVELS[log_level], logging.WARNING))


def flush() -> None:
    """Write what is queued (at exit: serve leaves with os._exit)."""
    if _LISTENER is not None:
        _LISTENER.stop()
