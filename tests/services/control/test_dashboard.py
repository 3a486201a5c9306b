"""The dashboard's static files at / of a real `xtoken control serve`: the page, its script and
styles with their content types and security headers, the vendored chart library with its licence,
no path out of the static folder, and the API routes untouched by the mount."""

from __future__ import annotations

import http.client
import re

import pytest

# a machine without the control extra (a GPU image) skips these, naming the install line
pytest.importorskip("fastapi", reason="the control plane's extra: pip install -e '.[control]'")

from services.control.app import STATIC_DIR
from tests.services.control.conftest import ControlServer

TOKEN = "dashboard-token"


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    """One server with a token for the module."""
    s = ControlServer(tmp_path_factory.mktemp("dashboard"), token=TOKEN)
    yield s
    s.stop()


def _raw_get(server: ControlServer, target: str) -> tuple[int, dict[str, str], bytes]:
    """GET ``target`` exactly as written (no client-side normalization of ``..`` or escapes)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    try:
        conn.putrequest("GET", target, skip_accept_encoding=True)
        conn.endheaders()
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


@pytest.mark.parametrize(
    ("path", "ctype", "marker"),
    [
        ("/", "text/html", b'<script src="app.js" defer></script>'),
        ("/index.html", "text/html", b"xtoken control plane"),
        ("/app.js", "text/javascript", b"new EventSource("),
        ("/lib.js", "text/javascript", b"window.xtoken = {"),
        ("/compare.js", "text/javascript", b"v1/compare?"),
        ("/style.css", "text/css", b".state-RUNNING"),
        ("/vendor/uplot/uPlot.iife.min.js", "text/javascript", b"var uPlot="),
        ("/vendor/uplot/uPlot.min.css", "text/css", b".uplot"),
    ],
)
def test_the_page_its_script_and_styles_are_served_with_their_content_types(
    api, path, ctype, marker
):
    status, headers, body = _raw_get(api, path)
    assert status == 200
    assert headers["content-type"].split(";")[0] == ctype
    assert marker in body
    assert headers["x-content-type-options"] == "nosniff"
    csp = headers["content-security-policy"]
    assert "script-src 'self'" in csp and "frame-ancestors 'none'" in csp


def test_every_asset_the_page_names_exists_and_the_chart_library_keeps_its_licence(api):
    _, _, page = _raw_get(api, "/")
    assets = re.findall(rb'(?:src|href)="([^"#:]+)"', page)
    assert len(assets) == 6, assets
    for asset in assets:
        assert _raw_get(api, "/" + asset.decode())[0] == 200, asset
    licence = (STATIC_DIR / "vendor" / "uplot" / "LICENSE").read_text()
    assert "MIT License" in licence and "Leon Sorokin" in licence


@pytest.mark.parametrize("script", ["/app.js", "/lib.js", "/compare.js"])
def test_the_scripts_never_write_markup(api, script):
    """Run names, configs, reasons and logs come from users: the scripts insert them as text
    only."""
    _, _, js = _raw_get(api, script)
    for sink in (b"innerHTML", b"outerHTML", b"insertAdjacentHTML", b"document.write", b"eval("):
        assert sink not in js, sink


@pytest.mark.parametrize(
    "target",
    [
        "/../app.py",
        "/../../../../etc/passwd",
        "/%2e%2e/app.py",
        "/%2e%2e/%2e%2e/%2e%2e/%2e%2e/etc/passwd",
        "/vendor/../../app.py",
        "/vendor/%2e%2e/%2e%2e/settings.py",
        "/vendor/..%2f..%2fapp.py",
        "/..%2fapp.py",
        "/%2f%2fetc%2fpasswd",
        "//etc/passwd",
        "/..%5capp.py",
        "/static/../app.py",
    ],
)
def test_the_static_route_cannot_escape_its_folder(api, target):
    status, _, body = _raw_get(api, target)
    assert status in (400, 404), (status, body[:200])
    assert b"create_app" not in body and b"BaseSettings" not in body and b"root:" not in body


def test_unknown_paths_get_a_json_404_and_the_api_is_not_shadowed(api):
    status, headers, body = _raw_get(api, "/nope.html")
    assert status == 404 and headers["content-type"] == "application/json"
    status, headers, body = _raw_get(api, "/v1/runs")
    assert status == 200 and headers["content-type"] == "application/json"
    assert body.startswith(b'{"runs":')
    assert _raw_get(api, "/healthz")[0] == 200
    status, _, body = _raw_get(api, "/v1/runs/nope/queue")
    assert status == 404 and b"GET /v1/runs" in body
