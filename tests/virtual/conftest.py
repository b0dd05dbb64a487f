"""Tests here run on the virtual clock (vega.lab.simclock): timers fire in order, at once."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest

from vega.lab.simclock import VirtualEventLoop


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item
                                  ) -> Mapping[str, Any]:
    return {"virtual": VirtualEventLoop}
