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


def require_token(request: Request) -> None:
    """Mutating calls come from this origin (:func:`refuse_cross_site`) and present
    ``Authorization: Bearer <token>`` when a token is configured.

    Raises:
        HTTPException: 403 from another origin; 401 without the header or with another token.
    """
    refuse_cross_site(request)
    token = request.app.state.settings.token
    if not token:
        return
    header = request.headers.get("authorization", "")
    scheme, _, given = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip(), token):
        raise HTTPException(
            status_code=401,
            detail="this call changes runs and needs 'Authorization: Bearer <token>' with the "
            "control plane's token (XTOKEN_CONTROL_TOKEN)",
            headers={"WWW-Authenticate": "Bearer"},
        )
