"""What the hostile-input tests share: the statuses allowed, the examples' budget, and
arbitrary JSON values."""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

# Answers a hostile request may get: an answer, a clear 4xx, or a refusal. Never a 5xx,
# but for a deadline of a few microseconds, past before the request was read (504).
ALLOWED = {200, 400, 413, 422, 429}


def allowed(status: int, body: bytes) -> bool:
    return status in ALLOWED or (status == 504 and b"deadline" in body)

SLOW = settings(max_examples=150, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda children: st.lists(children, max_size=8) | st.dictionaries(st.text(max_size=8),
                                                                      children, max_size=4),
    max_leaves=60)
