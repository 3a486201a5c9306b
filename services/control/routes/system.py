"""/healthz and /metrics (Prometheus text) of the control plane."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Depends
from fastapi.responses import PlainTextResponse

from services.control import prometheus
from services.control.deps import check_host, get_supervisor
from services.control.schemas import Health
from services.control.states import ACTIVE, STATES
from services.control.supervisor import Supervisor

router = APIRouter(tags=["system"])


@router.get("/healthz", response_model=Health)
def healthz(sup: Supervisor = Depends(get_supervisor)) -> dict[str, Any]:
    """Liveness: the API answers and its store is readable."""
    runs = sup.store.list_runs()
    return {
        "status": "ok",
        "runs": len(runs),
        "active": sum(r["state"] in ACTIVE for r in runs),
        "uptime_s": round(time.time() - sup.started, 3),
    }


@router.get("/metrics", response_class=PlainTextResponse, dependencies=[Depends(check_host)])
def metrics(sup: Supervisor = Depends(get_supervisor)) -> PlainTextResponse:
    """Prometheus text exposition: runs by state, tokens, step seconds by phase, loss parts,
    queue samples and bytes per partition, worker up, restarts, trainer memory."""
    text = prometheus.render(sup.snapshot(), states=STATES, now=time.time())
    return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")
