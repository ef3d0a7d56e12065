"""HTTPS (`--ssl-certfile`, `--ssl-keyfile`): the server answers over TLS with its certificate
(the ready line says https), and not in plain HTTP; a certificate without its key, or files
that are no certificate, stop the start before the model loads (one line, exit code 2)."""

from __future__ import annotations

import shutil
import ssl
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from server_fixtures import ServerProcess
from test_startup import assert_one_line_exit_2, run_serve

OPENSSL = shutil.which("openssl")
pytestmark = pytest.mark.skipif(OPENSSL is None, reason="no openssl to make a certificate")


@pytest.fixture(scope="module", name="cert")
def cert_fixture(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    folder = tmp_path_factory.mktemp("tls")
    cert, key = str(folder / "cert.pem"), str(folder / "key.pem")
    subprocess.run([str(OPENSSL), "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", key, "-out", cert], check=True, capture_output=True)  # fmt: skip
    return cert, key


@pytest.fixture(scope="module", name="tls_server")
def tls_server_fixture(cert: tuple[str, str]) -> Iterator[ServerProcess]:
    srv = ServerProcess(["--ssl-certfile", cert[0], "--ssl-keyfile", cert[1]])
    yield srv
    srv.stop()


def test_served_over_tls(tls_server: ServerProcess, cert: tuple[str, str]) -> None:
    assert tls_server.url.startswith("https://")
    trust = ssl.create_default_context(cafile=cert[0])
    with httpx.Client(base_url=tls_server.url, verify=trust, timeout=120) as http:
        assert http.get("/health").status_code == 200
        out = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3})
        assert out.status_code == 200 and out.json()["usage"]["completion_tokens"] == 3
    plain = tls_server.url.replace("https://", "http://")
    with pytest.raises(httpx.HTTPError):
        httpx.get(plain + "/health", timeout=10).raise_for_status()


def test_bad_tls_files_stop_the_start(cert: tuple[str, str], tmp_path: Path) -> None:
    proc = run_serve(["--ssl-certfile", cert[0]])
    assert_one_line_exit_2(proc, "--ssl-keyfile")
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate")
    proc = run_serve(["--ssl-certfile", str(junk), "--ssl-keyfile", cert[1]])
    assert_one_line_exit_2(proc, "--ssl-certfile", str(junk))
