"""The API docs pages work offline: /docs and /redoc name only assets of this server, each of them
is served (the Swagger UI and ReDoc bundles that the fastapi-offline package ships), and their
policy lets the browser load nothing from elsewhere."""

from __future__ import annotations

from html.parser import HTMLParser

import pytest

# a machine without the control extra (a GPU image) skips these, naming the install line
pytest.importorskip("fastapi", reason="the control plane's extra: pip install -e '.[control]'")

from fastapi.testclient import TestClient  # noqa: E402

from services.control.app import create_app
from services.control.settings import Settings


class _Refs(HTMLParser):
    """The URLs a page loads: script src, link href, img src."""

    def __init__(self) -> None:
        super().__init__()
        self.urls: list[tuple[str, str]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        wanted = {"script": "src", "link": "href", "img": "src"}.get(tag)
        for name, value in attrs:
            if name == wanted and value:
                self.urls.append((tag, value))


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    root = tmp_path_factory.mktemp("control")
    settings = Settings(runs_root=root / "runs", data_root=[root / "data"])
    # no lifespan: the docs need no supervisor
    return TestClient(create_app(settings), base_url="http://127.0.0.1")


def _refs(html: str) -> list[tuple[str, str]]:
    parser = _Refs()
    parser.feed(html)
    return parser.urls


CONTENT_TYPES = {".js": "javascript", ".css": "text/css", ".png": "image/png"}


@pytest.mark.parametrize(("page", "needs"), [("/docs", {".js", ".css"}), ("/redoc", {".js"})])
def test_a_docs_page_loads_only_local_assets_and_each_is_served(client, page, needs):
    response = client.get(page)
    assert response.status_code == 200
    html = response.text
    assert "cdn" not in html.lower() and "fonts.googleapis" not in html
    urls = [url for _, url in _refs(html)]
    suffixes = {url[url.rfind(".") :] for url in urls}
    assert needs <= suffixes, urls
    for url in urls:
        assert url.startswith("/") and not url.startswith("//"), f"{page} loads {url}"
        asset = client.get(url)
        assert asset.status_code == 200, url
        assert len(asset.content) > 1000, url  # the real bundle, not an empty file
        expected = CONTENT_TYPES[url[url.rfind(".") :]]
        assert expected in asset.headers["content-type"], (url, asset.headers)
    assert "/openapi.json" in html  # the spec comes from this server too


def test_swagger_ui_is_told_not_to_fetch_the_validator_badge(client):
    html = client.get("/docs").text
    assert '"validatorUrl": null' in html


@pytest.mark.parametrize("page", ["/docs", "/redoc", "/docs/oauth2-redirect"])
def test_a_docs_page_may_load_only_from_this_server(client, page):
    policy = client.get(page).headers["content-security-policy"]
    assert "default-src 'self'" in policy and "img-src 'self' data:" in policy
    assert "http" not in policy


def test_the_openapi_spec_stays_where_the_docs_read_it_and_lists_no_docs_routes(client):
    spec = client.get("/openapi.json").json()
    assert "/v1/runs" in spec["paths"]
    assert not any(p.startswith(("/docs", "/redoc")) for p in spec["paths"])


def test_the_swagger_oauth2_redirect_page_is_served(client):
    response = client.get("/docs/oauth2-redirect")
    assert response.status_code == 200 and "<script" in response.text
