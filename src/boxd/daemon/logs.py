"""Structured logs: one line per event, ``key=value`` pairs, the machine id on each.

    ts=2025-01-01T12:00:00.123Z level=info event=machine.ready machine=m-0123456789ab

The daemon logs with ``event(log, "machine.ready", machine=...)``; lines from other
libraries (uvicorn, the runtime) come out in the same shape with their text in ``msg``.
"""

from __future__ import annotations

import logging
import sys
from datetime import UTC, datetime
from typing import Any, TextIO

_FIELDS = "boxd_fields"


def event(log: logging.Logger, name: str, /, *, level: int = logging.INFO, **fields: Any) -> None:
    log.log(level, name, extra={_FIELDS: fields})


def _value(value: Any) -> str:
    text = str(value)
    if text and not any(c in text for c in ' "=\n\t'):
        return text
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


class KeyValueFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        stamp = datetime.fromtimestamp(record.created, tz=UTC).isoformat(timespec="milliseconds")
        pairs: dict[str, Any] = {"ts": stamp.replace("+00:00", "Z"), "level": record.levelname.lower()}
        fields = getattr(record, _FIELDS, None)
        if fields is None:
            pairs.update(event="log", logger=record.name, msg=record.getMessage())
        else:
            pairs.update(event=record.getMessage(), **fields)
        if record.exc_info:
            pairs["error"] = self.formatException(record.exc_info)
        return " ".join(f"{key}={_value(value)}" for key, value in pairs.items() if value is not None)


def configure(stream: TextIO = sys.stderr, level: int = logging.INFO) -> None:
    handler = logging.StreamHandler(stream)
    handler.setFormatter(KeyValueFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
