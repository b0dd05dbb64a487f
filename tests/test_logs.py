"""Log lines a flood repeats: thinned, tracebacks never."""

from __future__ import annotations

import logging

from vega.logs import Repeats


def record(msg: str, traceback: bool = False) -> logging.LogRecord:
    info = (ValueError, ValueError("x"), None) if traceback else None
    return logging.LogRecord("uvicorn.error", logging.WARNING, __file__, 1, msg, None, info)


def test_a_repeated_line_passes_once_an_interval_but_every_traceback_passes() -> None:
    repeats = Repeats(every_s=60)
    floods = [record("Invalid HTTP request received.") for _ in range(5)]
    assert [repeats.filter(r) for r in floods] == [True, False, False, False, False]
    assert repeats.filter(record("Unsupported upgrade request."))  # another message
    assert all(repeats.filter(record("Exception in ASGI application\n", traceback=True))
               for _ in range(3))  # each may be another bug
    repeats.every_s = 0
    later = record("Invalid HTTP request received.")
    assert repeats.filter(later) and "(and 4 more like it in the last" in str(later.msg)
