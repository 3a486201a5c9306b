"""The API docs pages, ``/docs`` (Swagger UI) and ``/redoc``, served with the JavaScript and CSS
that the ``fastapi-offline`` package ships (Swagger UI 5, ReDoc 2), so that they work without
network: FastAPI's own pages load them from a CDN and stay blank offline."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.openapi.docs import (
    get_redoc_html,
    get_swagger_ui_html,
    get_swagger_ui_oauth2_redirect_html,
)
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

# where the docs' assets are served (swagger-ui-bundle.js, swagger-ui.css, redoc.standalone.js)
ASSETS_URL = "/docs-assets"
DOCS_URL = "/docs"
REDOC_URL = "/redoc"
# Swagger UI's settings: FastAPI's defaults, without the validator badge (an image it would
# fetch from validator.swagger.io)
SWAGGER_UI_PARAMETERS = {"validatorUrl": None}
# The pages load nothing from elsewhere, whatever their bundles ask for (ReDoc's footer always
# asks for a logo on cdn.redoc.ly): the browser refuses it without a request. The inline script
# starts Swagger UI; both bundles set inline styles; ReDoc searches in a blob worker.
DOCS_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; script-src 'self' 'unsafe-inline'; "
    "style-src 'self' 'unsafe-inline'; img-src 'self' data:; worker-src 'self' blob:; "
    "object-src 'none'; base-uri 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


def assets_dir() -> Path:
    """The folder of the docs' assets, inside the installed ``fastapi-offline`` package.

    Raises:
        ModuleNotFoundError: the package is missing (the ``control`` extra installs it).
    """
    import fastapi_offline

    return Path(fastapi_offline.__file__).resolve().parent / "static"


def add_docs(app: FastAPI) -> None:
    """Serve ``/docs``, its OAuth2 redirect page and ``/redoc`` from local assets.

    Args:
        app: made with ``docs_url=None, redoc_url=None`` (FastAPI's CDN pages off).
    """
    app.mount(ASSETS_URL, StaticFiles(directory=assets_dir()), name="docs-assets")
    openapi_url = app.openapi_url or "/openapi.json"
    redirect_url = app.swagger_ui_oauth2_redirect_url or f"{DOCS_URL}/oauth2-redirect"

    @app.get(DOCS_URL, include_in_schema=False)
    async def swagger_ui(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        return _local(
            get_swagger_ui_html(
                openapi_url=f"{root}{openapi_url}",
                title=f"{app.title} - Swagger UI",
                oauth2_redirect_url=f"{root}{redirect_url}",
                swagger_js_url=f"{root}{ASSETS_URL}/swagger-ui-bundle.js",
                swagger_css_url=f"{root}{ASSETS_URL}/swagger-ui.css",
                swagger_favicon_url=f"{root}{ASSETS_URL}/favicon.png",
                swagger_ui_parameters=SWAGGER_UI_PARAMETERS,
            )
        )

    @app.get(redirect_url, include_in_schema=False)
    async def swagger_ui_redirect() -> HTMLResponse:
        return _local(get_swagger_ui_oauth2_redirect_html())

    @app.get(REDOC_URL, include_in_schema=False)
    async def redoc(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        return _local(
            get_redoc_html(
                openapi_url=f"{root}{openapi_url}",
                title=f"{app.title} - ReDoc",
                redoc_js_url=f"{root}{ASSETS_URL}/redoc.standalone.js",
                redoc_favicon_url=f"{root}{ASSETS_URL}/favicon.png",
                with_google_fonts=False,
            )
        )


def _local(page: HTMLResponse) -> HTMLResponse:
    """``page`` with :data:`DOCS_HEADERS` (it may load only what this server serves)."""
    page.headers.update(DOCS_HEADERS)
    return page
