"""Log lines a flood repeats, let through once an interval each, with a count.

uvicorn warns once per connection of anything that is not HTTP ("Invalid HTTP request
received.": a TLS client or a port scanner on the plain port), or asks for an upgrade:
at a thousand such connections a second that is a thousand lines, written by the loop
that should be answering requests.
"""

from __future__ import annotations

import logging
import time

REPEAT_EVERY_S = 10.0


class Repeats(logging.Filter):
    """Passes a message (by its logger and text before formatting) once per ``every_s``;
    the next one to pass says how many were held back meanwhile. A record with a
    traceback always passes."""

    def __init__(self, every_s: float = REPEAT_EVERY_S) -> None:
        super().__init__()
        self.every_s = every_s
        self._seen: dict[tuple[str, str], tuple[float, int]] = {}  # -> (passed at, held)

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info:  # a traceback: each may be another bug
            return True
        key = (record.name, str(record.msg))
        now = time.monotonic()
        passed_at, held = self._seen.get(key, (-self.every_s, 0))
        if now - passed_at < self.every_s:
            self._seen[key] = (passed_at, held + 1)
            return False
        self._seen[key] = (now, 0)
        if held:
            record.msg = f"{record.msg} (and {held} more like it in the last " \
                f"{now - passed_at:.0f} s)"
        return True
