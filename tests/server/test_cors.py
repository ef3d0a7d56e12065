"""CORS (`--allowed-origins`): by default a browser page of any origin may call the API, as
vLLM's and SGLang's servers allow: a preflight is answered (before the API key is looked at)
with the method and headers asked for, and answers, errors included, carry the origin header;
with a list of origins only those get them."""

from __future__ import annotations

import random
from collections.abc import Iterator

import httpx
import pytest
from server_fixtures import (  # noqa: F401 (fixtures)
    API_KEY,
    ServerProcess,
    key_server_fixture,
    server_fixture,
)


def origin() -> str:
    return f"https://app{random.randrange(10**6)}.example"


def preflight(url: str, path: str, site: str) -> httpx.Response:
    headers = {"origin": site, "access-control-request-method": "POST",
               "access-control-request-headers": "authorization, content-type"}  # fmt: skip
    return httpx.options(url + path, headers=headers)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/responses", "/generate"])
def test_any_origin_by_default(key_server: ServerProcess, path: str) -> None:
    site = origin()
    pre = preflight(key_server.url, path, site)
    assert pre.status_code == 200, pre.text  # no API key asked of a preflight
    assert pre.headers["access-control-allow-origin"] == "*"
    assert "POST" in pre.headers["access-control-allow-methods"]
    assert "authorization" in pre.headers["access-control-allow-headers"].lower()
    # The call itself: its answer, and a 401 for a wrong key, readable by the page.
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    for key, status in ((API_KEY, 200), ("wrong", 401)):
        headers = {"origin": site, "authorization": f"Bearer {key}"}
        resp = httpx.post(key_server.url + "/v1/chat/completions", json=body, headers=headers,
                          timeout=120)  # fmt: skip
        assert resp.status_code == status and resp.headers["access-control-allow-origin"] == "*"


@pytest.fixture(scope="module", name="allowed")
def allowed_fixture() -> Iterator[tuple[ServerProcess, list[str]]]:
    sites = [origin(), origin()]
    srv = ServerProcess(["--allowed-origins", ",".join(sites)])
    yield srv, sites
    srv.stop()


def test_only_the_allowed_origins(allowed: tuple[ServerProcess, list[str]]) -> None:
    srv, sites = allowed
    site = random.choice(sites)
    pre = preflight(srv.url, "/v1/completions", site)
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == site
    other = preflight(srv.url, "/v1/completions", origin())
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    got = httpx.get(srv.url + "/v1/models", headers={"origin": origin()})
    assert got.status_code == 200 and "access-control-allow-origin" not in got.headers
    got = httpx.get(srv.url + "/v1/models", headers={"origin": site})
    assert got.headers["access-control-allow-origin"] == site
