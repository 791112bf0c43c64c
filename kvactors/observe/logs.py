"""Structured logging for kvactors: ``extra=`` fields, and an optional JSON-lines formatter.

kvactors logs under the ``kvactors`` logger hierarchy and never configures logging on import.
Context goes into ``extra=`` fields (``device``, ``actor``, ``transfer_id``, ``nbytes`` ...)
rather than only into the message, so a JSON log can be filtered by them::

    log = get_logger("kvactors.demo")
    log.info("store done", extra={"device": "mlu:0", "nbytes": 2097152})

:func:`configure` installs a stderr handler on the ``kvactors`` logger, either plain text
(extra fields appended as ``key=value``) or one JSON object per line (:class:`JsonFormatter`).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any, TextIO

__all__ = ("JsonFormatter", "KeyValueFormatter", "configure", "get_logger", "record_extras")

_STANDARD = frozenset(logging.LogRecord("x", logging.INFO, "x", 0, "x", None, None).__dict__) | {
    "message",
    "asctime",
    "taskName",
}


def get_logger(name: str = "kvactors") -> logging.Logger:
    """A logger under the ``kvactors`` hierarchy."""
    return logging.getLogger(name if name.startswith("kvactors") else f"kvactors.{name}")


def record_extras(record: logging.LogRecord) -> dict[str, Any]:
    """The ``extra=`` fields of ``record`` (everything not a standard LogRecord attribute)."""
    items = record.__dict__.items()
    return {k: v for k, v in items if k not in _STANDARD and not k.startswith("_")}


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ``ts``, ``level``, ``logger``, ``msg``, then the extras."""

    def format(self, record: logging.LogRecord) -> str:
        """Format ``record`` as a JSON line (values that are not JSON become ``repr``)."""
        out: dict[str, Any] = {
            "ts": round(record.created, 6),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
            "thread": record.threadName,
        }
        out.update(record_extras(record))
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=repr)


class KeyValueFormatter(logging.Formatter):
    """Plain text with the extras appended as ``key=value``."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")
        self.converter = time.gmtime

    def format(self, record: logging.LogRecord) -> str:
        """Format ``record`` with its extras."""
        base = super().format(record)
        extras = record_extras(record)
        if extras:
            base += " " + " ".join(f"{k}={v}" for k, v in sorted(extras.items()))
        return base


_HANDLER_FLAG = "_kvactors_handler"


def configure(
    level: int | str = logging.WARNING, *, json_format: bool = False, stream: TextIO | None = None
) -> logging.Handler:
    """Send ``kvactors`` logs to ``stream`` (stderr) in text or JSON; replaces an earlier call's.

    Args:
        level: Level of the ``kvactors`` logger (name or number).
        json_format: Use :class:`JsonFormatter` instead of :class:`KeyValueFormatter`.
        stream: Where to write (default ``sys.stderr``).

    Returns:
        The installed handler.
    """
    logger = logging.getLogger("kvactors")
    for h in list(logger.handlers):
        if getattr(h, _HANDLER_FLAG, False):
            logger.removeHandler(h)
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(JsonFormatter() if json_format else KeyValueFormatter())
    setattr(handler, _HANDLER_FLAG, True)
    logger.addHandler(handler)
    logger.setLevel(level.upper() if isinstance(level, str) else level)
    return handler
