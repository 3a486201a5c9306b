"""The control plane's FastAPI app: create_app, lifespan (store + supervisor), errors, body limit,
the API docs (offline), the dashboard's static files at /."""

from __future__ import annotations

import logging
import mimetypes
import re
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.common.config import ConfigError
from services.control.docs import add_docs
from services.control.paths import PathNotAllowed
from services.control.routes import compare, runs, system
from services.control.settings import Settings
from services.control.states import Conflict, RunNotFound
from services.control.store import Store
from services.control.supervisor import Supervisor

logger = logging.getLogger(__name__)

STATIC_DIR = Path(__file__).resolve().parent / "static"
# The dashboard loads only its own files and talks only to this origin; user-given text is
# inserted as text (app.js), and this policy stops any script that slipped in anyway.
DASHBOARD_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; connect-src 'self'; "
    "style-src 'self' 'unsafe-inline'; img-src 'self' data:; object-src 'none'; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}
# the platform's table can lack them or name .js text/plain (browsers refuse it under nosniff)
mimetypes.add_type("text/javascript", ".js")
mimetypes.add_type("text/css", ".css")
# a dotted key, an entry of a list of sections included (extra_teachers[0].model)
_KEY = r"[a-z_][\w.]*(?:\[\d+\][\w.]*)*"
_KEY_PATTERNS = (
    re.compile(rf"unknown key '({_KEY})'"),
    re.compile(rf"^({_KEY})(?::|=| )"),
)


def _config_roots() -> set[str]:
    import dataclasses

    from services.supervise.config import RunConfig

    return {f.name for f in dataclasses.fields(RunConfig)}


def config_error_key(message: str) -> str | None:
    """The dotted config key a ConfigError message names, if any."""
    for pattern in _KEY_PATTERNS:
        m = pattern.search(message)
        if m and re.split(r"[.\[]", m.group(1))[0] in _config_roots():
            return m.group(1)
    return None


class BodyLimit:
    """ASGI middleware: a request body over ``max_bytes`` gets 413 (by Content-Length at once,
    or as soon as a chunked body passes the limit)."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await self._refuse(scope, receive, send)
            return
        seen = 0
        started = False

        async def limited_receive() -> dict:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise _TooLarge
            return message

        async def tracking_send(message: dict) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except _TooLarge:
            if not started:
                await self._refuse(scope, receive, send)

    async def _refuse(self, scope: dict, receive: Any, send: Any) -> None:
        response = JSONResponse(
            {
                "error": f"the request body is larger than {self.max_bytes} bytes "
                "(XTOKEN_CONTROL_MAX_BODY_BYTES); send a smaller config"
            },
            status_code=413,
        )
        await response(scope, receive, send)


class _TooLarge(Exception):
    pass


class DashboardFiles(StaticFiles):
    """The dashboard's static files (``/`` is index.html), with :data:`DASHBOARD_HEADERS`.
    Starlette resolves each path and refuses any outside the folder (``..``, symlinks)."""

    async def get_response(self, path: str, scope: Any) -> Any:
        response = await super().get_response(path, scope)
        response.headers.update(DASHBOARD_HEADERS)
        return response


class ServerTiming:
    """ASGI middleware: ``Server-Timing: app;dur=<ms>`` on every response (the time the app took
    until its headers, without the network and the client: what a latency figure can blame on
    the control plane itself)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()

        async def timed_send(message: dict) -> None:
            if message["type"] == "http.response.start":
                ms = (time.perf_counter() - start) * 1e3
                headers = list(message.get("headers") or [])
                headers.append((b"server-timing", f"app;dur={ms:.3f}".encode()))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, timed_send)


def _error(status: int, message: str, key: str | None = None, headers: Any = None) -> JSONResponse:
    body: dict[str, Any] = {"error": message}
    if key is not None:
        body["key"] = key
    return JSONResponse(body, status_code=status, headers=headers)


def create_app(
    settings: Settings | None = None,
    supervisor: Supervisor | None = None,
    on_ready: Callable[[], None] | None = None,
) -> FastAPI:
    """The control plane app.

    Args:
        settings: the settings (default: from the environment).
        supervisor: a ready supervisor (default: one over ``settings``' store, built and
            recovered in the lifespan, its threads stopped on shutdown; runs go on).
        on_ready: called once the supervisor is up (``--ready-file``).

    Returns:
        The FastAPI app (OpenAPI at /docs and /redoc, served without network).
    """
    settings = settings or Settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        own = supervisor is None
        sup = supervisor or build_supervisor(settings)
        app.state.supervisor = sup
        if own:
            sup.recover()
        logger.info("[control] ready: runs under %s, store %s", sup.runs_root, settings.db_path())
        if on_ready is not None:
            on_ready()
        try:
            yield
        finally:
            if own:
                sup.shutdown()
                sup.store.close()

    app = FastAPI(
        title="xtoken control plane",
        version="1",
        description="Start, stop, resume and watch cross-tokenizer distillation runs.",
        lifespan=lifespan,
        docs_url=None,  # served by add_docs from local assets, not a CDN
        redoc_url=None,
    )
    add_docs(app)
    app.state.settings = settings
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    app.add_middleware(ServerTiming)

    @app.exception_handler(ConfigError)
    async def _config_error(request: Request, exc: ConfigError) -> JSONResponse:
        return _error(422, str(exc), config_error_key(str(exc)))

    @app.exception_handler(PathNotAllowed)
    async def _path_error(request: Request, exc: PathNotAllowed) -> JSONResponse:
        return _error(403, str(exc), exc.key)

    @app.exception_handler(Conflict)
    async def _conflict(request: Request, exc: Conflict) -> JSONResponse:
        return _error(409, str(exc))

    @app.exception_handler(RunNotFound)
    async def _not_found(request: Request, exc: RunNotFound) -> JSONResponse:
        return _error(404, f"no run {exc.args[0]!r}; GET /v1/runs lists the runs")

    @app.exception_handler(ValueError)
    async def _bad_value(request: Request, exc: ValueError) -> JSONResponse:
        return _error(422, str(exc), config_error_key(str(exc)))

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        parts = []
        for err in exc.errors():
            where = ".".join(str(x) for x in err.get("loc", ()))
            parts.append(f"{where}: {err.get('msg')}")
        return _error(422, "; ".join(parts) or "invalid request")

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))

    app.include_router(system.router)
    app.include_router(runs.router)
    app.include_router(compare.router)
    if STATIC_DIR.is_dir():  # last: the API's routes come first
        app.mount("/", DashboardFiles(directory=STATIC_DIR, html=True), name="dashboard")
    return app


def build_supervisor(settings: Settings) -> Supervisor:
    """A supervisor over the settings' store, roots and launcher."""
    settings.runs_root.mkdir(parents=True, exist_ok=True)
    return Supervisor(
        Store(settings.db_path()),
        runs_root=settings.runs_root,
        data_roots=list(settings.data_root),
        launcher_factory=_launcher_factory(settings),
        tick_s=settings.tick_s,
        dead_after_s=settings.dead_after_s,
        default_queue=settings.queue,
        max_run_processes=settings.max_run_processes,
        max_processes=settings.max_processes,
    )


def _launcher_factory(settings: Settings) -> Any:
    """New launchers for runs: local ones without the dead-parent sentinel (run processes
    outlive a control-plane restart and are re-attached), or Ray ones on the cluster."""
    from services.launch import make_launcher

    if settings.launcher == "local":
        return lambda: make_launcher("local", parent_sentinel=False)
    return lambda: make_launcher(settings.launcher, settings.ray_address)
