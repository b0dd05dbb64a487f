"""Bearer tokens, request ids, and secrets kept out of what Vega prints."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import orjson
import pytest

from tests.models import window
from tests.servers import VegaProcess

BODY = orjson.dumps({"inputs": window(8)})


@pytest.fixture(scope="module")
def guarded(vega_module: Callable[..., VegaProcess]) -> VegaProcess:
    return vega_module(VEGA_MODEL="python:tests.models:echo",
                       VEGA_AUTH_TOKENS="alpha-token, beta-token",  # trimmed, both good
                       VEGA_REDIS_URL="redis://:pa55word@127.0.0.1:1/0",
                       VEGA_LOG_LEVEL="debug")


def test_api_needs_a_known_bearer_token(guarded: VegaProcess) -> None:
    anonymous = httpx.post(guarded.url + "/v1/infer", content=BODY)
    assert anonymous.status_code == 401
    assert anonymous.json()["error"]["code"] == "unauthorized"
    assert anonymous.headers["www-authenticate"].startswith("Bearer")
    wrong = httpx.post(guarded.url + "/v1/infer", content=BODY,
                       headers={"Authorization": "Bearer alpha-tokenX"})
    assert wrong.status_code == 401
    for token in ("alpha-token", "beta-token"):
        ok = httpx.post(guarded.url + "/v1/infer", content=BODY,
                        headers={"Authorization": f"Bearer {token}"})
        assert ok.status_code == 200
    assert httpx.get(guarded.url + "/v1/status").status_code == 401
    v2 = httpx.post(guarded.url + "/v2/models/echo/infer", content=b"{}")
    assert v2.status_code == 401 and v2.json() == {  # the protocol's own error shape
        "error": "unauthorized: missing or unknown bearer token"}


def test_health_and_metrics_stay_open(guarded: VegaProcess) -> None:
    for path in ("/healthz", "/readyz", "/metrics"):
        assert httpx.get(guarded.url + path).status_code == 200, path


def test_request_ids_are_echoed_sanitised_and_bounded(guarded: VegaProcess) -> None:
    auth = {"Authorization": "Bearer alpha-token"}
    kept = httpx.post(guarded.url + "/v1/infer", content=BODY,
                      headers={**auth, "X-Request-Id": "abc-123"})
    assert kept.headers["x-request-id"] == "abc-123"
    hostile = httpx.post(guarded.url + "/v1/infer", content=BODY,
                         headers={**auth, "X-Request-Id": "evil\tid<script>" + "x" * 500})
    echoed = hostile.headers["x-request-id"]
    assert echoed.startswith("evilidscript") and len(echoed) == 64
    fresh = httpx.post(guarded.url + "/v1/infer", content=BODY, headers=auth)
    assert fresh.headers["x-request-id"] != kept.headers["x-request-id"]


def test_secrets_never_reach_the_log(guarded: VegaProcess) -> None:
    httpx.post(guarded.url + "/v1/infer", content=BODY)  # an unauthorised attempt
    log = guarded.log()
    assert log and "pa55word" not in log and "alpha-token" not in log
