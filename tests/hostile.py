"""What the hostile-input tests share: the statuses allowed, the examples' budget, and
arbitrary JSON values."""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

# Answers a hostile request may get: an answer, a clear 4xx, or a refusal. Never a 5xx.
ALLOWED = {200, 400, 413, 422, 429}

SLOW = settings(max_examples=150, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda children: st.lists(children, max_size=8) | st.dictionaries(st.text(max_size=8),
                                                                      children, max_size=4),
    max_leaves=60)
