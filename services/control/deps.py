"""FastAPI dependencies of the control plane: the settings, the supervisor, the bearer token."""

from __future__ import annotations

import hmac

from fastapi import HTTPException, Request

from services.control.settings import Settings
from services.control.supervisor import Supervisor


def get_settings(request: Request) -> Settings:
    """The app's settings."""
    return request.app.state.settings


def get_supervisor(request: Request) -> Supervisor:
    """The app's supervisor."""
    return request.app.state.supervisor


def require_token(request: Request) -> None:
    """Mutating calls present ``Authorization: Bearer <token>`` when a token is configured.

    Raises:
        HTTPException: 401 without the header or with another token.
    """
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
