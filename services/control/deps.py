"""FastAPI dependencies of the control plane: settings, supervisor, bearer token, same-origin check."""

from __future__ import annotations

import hmac
from urllib.parse import urlsplit

from fastapi import HTTPException, Request

from services.control.settings import Settings, is_loopback
from services.control.supervisor import Supervisor


def get_settings(request: Request) -> Settings:
    """The app's settings."""
    return request.app.state.settings


def get_supervisor(request: Request) -> Supervisor:
    """The app's supervisor."""
    return request.app.state.supervisor


def refuse_cross_site(request: Request) -> None:
    """A mutating call from a web page of another origin is refused, and so is one without a
    token whose Host is not a loopback name.

    Any page the user opens can send a form-like POST to ``http://127.0.0.1:8000`` (no CORS
    preflight for ``text/plain``), and a DNS-rebinding page can even read the answers; without a
    token nothing else would stop it from starting runs through the user's browser. Clients that
    are not browsers (curl, httpx) send no ``Origin``; the dashboard's own calls are same-origin.

    Raises:
        HTTPException: 403 naming the origin or host and what to do.
    """
    origin = request.headers.get("origin")
    host = request.headers.get("host", "")
    site = request.headers.get("sec-fetch-site", "")
    if site == "cross-site" or (origin is not None and urlsplit(origin).netloc != host):
        raise HTTPException(
            status_code=403,
            detail=f"a call from the web page of another origin ({origin or site}) may not "
            f"change runs here ({host}); use the dashboard served by this control plane, or "
            "call the API outside a browser (curl)",
        )
    if not request.app.state.settings.token and not is_loopback(
        urlsplit(f"//{host}").hostname or ""
    ):
        raise HTTPException(
            status_code=403,
            detail=f"this control plane has no token and answers changes only to a loopback "
            f"Host, not {host!r}; set XTOKEN_CONTROL_TOKEN to reach it under another name",
        )


def _presents_token(request: Request) -> bool:
    token = request.app.state.settings.token
    if not token:
        return False
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip(), token)


def check_host(request: Request) -> None:
    """A read is answered under a loopback Host, the bound address or an allowed host
    (``XTOKEN_CONTROL_ALLOWED_HOSTS``), or with the token.

    A DNS-rebinding page (rebound.example resolved to this server) is same-origin to itself and
    could read every run's config, logs and metrics; its Host names the page's domain, which is
    none of these, and it cannot know the token.

    Raises:
        HTTPException: 403 naming the Host and the setting.
    """
    settings = request.app.state.settings
    host = request.headers.get("host", "")
    if settings.host_allowed(host) or _presents_token(request):
        return
    raise HTTPException(
        status_code=403,
        detail=f"this control plane answers reads under Host {host!r} only with its token; "
        "call it by a loopback name or its bound address, add the name to "
        "XTOKEN_CONTROL_ALLOWED_HOSTS, or send 'Authorization: Bearer <token>' "
        "(XTOKEN_CONTROL_TOKEN)",
    )


def require_token(request: Request) -> None:
    """Mutating calls come from this origin (:func:`refuse_cross_site`) and present
    ``Authorization: Bearer <token>`` when a token is configured.

    Raises:
        HTTPException: 403 from another origin; 401 without the header or with another token.
    """
    refuse_cross_site(request)
    if not request.app.state.settings.token or _presents_token(request):
        return
    raise HTTPException(
        status_code=401,
        detail="this call changes runs and needs 'Authorization: Bearer <token>' with the "
        "control plane's token (XTOKEN_CONTROL_TOKEN)",
        headers={"WWW-Authenticate": "Bearer"},
    )
