"""/v1/runs: submit, list, inspect, stop and resume runs; their processes, metrics, events, logs."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import PlainTextResponse, StreamingResponse

from services.control import logs as log_files
from services.control.body import parse_body
from services.control.deps import check_host, get_supervisor, require_token
from services.control.schemas import (
    ErrorOut,
    MetricsOut,
    ProcessList,
    QueueHistoryOut,
    QueueOut,
    RunList,
    RunOut,
    StopRequest,
)
from services.control.states import ACTIVE
from services.control.supervisor import Supervisor

# every call checks its Host first (reads too: DNS rebinding); writes then need the token
router = APIRouter(prefix="/v1/runs", tags=["runs"], dependencies=[Depends(check_host)])

_ERRORS: dict[int | str, dict[str, Any]] = {
    401: {"model": ErrorOut, "description": "missing or wrong bearer token"},
    403: {"model": ErrorOut, "description": "a Host that is not allowed (reads), another origin"},
    404: {"model": ErrorOut, "description": "no such run"},
}
SSE_KEEPALIVE_S = 15.0


@router.post(
    "",
    status_code=201,
    response_model=RunOut,
    dependencies=[Depends(require_token)],
    responses={
        **_ERRORS,
        403: {"model": ErrorOut, "description": "a path outside the runs / data roots"},
        409: {"model": ErrorOut, "description": "another run owns the run directory (named)"},
        413: {"model": ErrorOut, "description": "the body is larger than max_body_bytes"},
        422: {"model": ErrorOut, "description": "a bad config: names the key and the fix"},
    },
    openapi_extra={
        "requestBody": {
            "required": True,
            "description": "a run config (examples/tiny.yaml) as JSON or YAML",
            "content": {
                "application/json": {"schema": {"type": "object"}},
                "application/yaml": {"schema": {"type": "string"}},
            },
        }
    },
)
async def submit_run(
    request: Request,
    name: str | None = Query(None, max_length=100, description="display name"),
    sup: Supervisor = Depends(get_supervisor),
) -> dict[str, Any]:
    """Validate a run config and start the run (state PENDING, then STARTING)."""
    body = await request.body()
    # parsed in a worker thread: the event loop (/healthz, event streams) never waits on it
    raw = await asyncio.to_thread(
        parse_body,
        body,
        request.headers.get("content-type", ""),
        request.app.state.settings.body_limits(),
    )
    return await asyncio.to_thread(sup.submit, raw, name)


@router.get("", response_model=RunList)
def list_runs(sup: Supervisor = Depends(get_supervisor)) -> dict[str, Any]:
    """Every run, oldest first (without configs)."""
    return {"runs": sup.list()}


@router.get("/{run_id}", response_model=RunOut, responses=_ERRORS)
def get_run(run_id: str, sup: Supervisor = Depends(get_supervisor)) -> dict[str, Any]:
    """State, config, step, latest metrics, checkpoint and failure reason of a run."""
    return sup.get(run_id)


@router.post(
    "/{run_id}/stop",
    status_code=202,
    response_model=RunOut,
    dependencies=[Depends(require_token)],
    responses={**_ERRORS, 409: {"model": ErrorOut, "description": "the run is not active"}},
)
def stop_run(
    run_id: str, body: StopRequest | None = None, sup: Supervisor = Depends(get_supervisor)
) -> dict[str, Any]:
    """Graceful stop: every trainer rank stops at one step boundary and checkpoints, then all
    processes exit (killed after ``grace_s``)."""
    return sup.stop(run_id, grace_s=(body or StopRequest()).grace_s)


@router.post(
    "/{run_id}/resume",
    status_code=202,
    response_model=RunOut,
    dependencies=[Depends(require_token)],
    responses={
        **_ERRORS,
        409: {"model": ErrorOut, "description": "the run is not resumable"},
        422: {"model": ErrorOut, "description": "its processes are past the control plane's cap"},
    },
)
def resume_run(run_id: str, sup: Supervisor = Depends(get_supervisor)) -> dict[str, Any]:
    """Start a STOPPED, FAILED or INTERRUPTED run again from its latest checkpoint, under the same
    record and directory (event ``resumed``)."""
    return sup.resume(run_id)


@router.get("/{run_id}/processes", response_model=ProcessList, responses=_ERRORS)
def list_processes(run_id: str, sup: Supervisor = Depends(get_supervisor)) -> dict[str, Any]:
    """Role, host, pid, GPU, state, restarts, last heartbeat and exit code of each process."""
    return {"run_id": run_id, "processes": sup.processes(run_id)}


@router.get("/{run_id}/metrics", response_model=MetricsOut, responses=_ERRORS)
def get_metrics(
    run_id: str,
    after_step: int = Query(-1, description="only steps after this one"),
    sup: Supervisor = Depends(get_supervisor),
) -> dict[str, Any]:
    """Series for curves: one record per step (loss parts, tokens/s, step-time split) and the
    held-out evals."""
    return sup.metrics(run_id, after_step=after_step)


@router.get("/{run_id}/queue", response_model=QueueOut, responses=_ERRORS)
def get_queue(run_id: str, sup: Supervisor = Depends(get_supervisor)) -> dict[str, Any]:
    """Queue depth of a run: samples and bytes per partition, leases and capacity, as its queue
    last reported them (asked every 2 s while the run is active)."""
    return sup.queue(run_id)


@router.get("/{run_id}/queue/history", response_model=QueueHistoryOut, responses=_ERRORS)
def get_queue_history(
    run_id: str,
    after: float | None = Query(None, description="only samples taken after this unix time"),
    sup: Supervisor = Depends(get_supervisor),
) -> dict[str, Any]:
    """Queue depth over the run's life, as the control plane sampled it (bounded: at most
    ``max_points`` samples, thinned evenly past that); kept with the run, so a finished run
    shows what was recorded (``points`` empty: nothing was)."""
    return sup.queue_history(run_id, after=after)


def _sse(event: dict[str, Any]) -> str:
    head = f"id: {event['id']}\n" if event.get("id") is not None else ""
    payload = {k: v for k, v in event.items() if k != "run_id"}
    return f"{head}event: {event['kind']}\ndata: {json.dumps(payload)}\n\n"


@router.get(
    "/{run_id}/events",
    responses={**_ERRORS, 200: {"content": {"text/event-stream": {}}}},
    response_class=StreamingResponse,
)
async def stream_events(
    run_id: str,
    request: Request,
    after: int = Query(0, ge=0, description="replay recorded events after this id"),
    sup: Supervisor = Depends(get_supervisor),
) -> StreamingResponse:
    """Server-sent events: recorded events after ``after`` (or ``Last-Event-ID``), then live
    ones: ``state``, process events (``exited``, ``recovering``, ``restarted``...) and
    ``metrics`` (one per trainer step or eval)."""
    last = request.headers.get("last-event-id", "")
    if last.isdigit():
        after = max(after, int(last))
    loop = asyncio.get_running_loop()
    inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue(maxsize=10000)

    def deliver(event: dict[str, Any]) -> None:
        loop.call_soon_threadsafe(_offer, inbox, event)

    unsubscribe = sup.subscribe(run_id, deliver)
    replay = sup.events(run_id, after=after)

    async def stream() -> AsyncIterator[str]:
        try:
            seen = after
            yield ": xtoken events\n\n"
            for event in replay:
                seen = max(seen, event["id"])
                yield _sse(event)
            while True:
                try:
                    event = await asyncio.wait_for(inbox.get(), SSE_KEEPALIVE_S)
                except TimeoutError:
                    if await request.is_disconnected():
                        return
                    yield ": keep-alive\n\n"
                    continue
                if event.get("id") is not None:
                    if event["id"] <= seen:
                        continue
                    seen = event["id"]
                yield _sse(event)
        finally:
            unsubscribe()

    return StreamingResponse(
        stream(),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


def _offer(inbox: asyncio.Queue, event: dict[str, Any]) -> None:
    try:
        inbox.put_nowait(event)
    except asyncio.QueueFull:  # a stalled client loses live events, never the server's memory
        pass


@router.get(
    "/{run_id}/logs",
    responses={**_ERRORS, 200: {"content": {"text/plain": {}}}},
    response_class=PlainTextResponse,
)
async def get_logs(
    run_id: str,
    request: Request,
    process: str = Query(..., description="process name (GET .../processes lists them)"),
    follow: bool = Query(False, description="stream new lines until the run ends"),
    lines: int = Query(200, ge=1, le=100000, description="last lines to show first"),
    sup: Supervisor = Depends(get_supervisor),
) -> Any:
    """The log of one process: its last ``lines`` lines (at most 4 MiB of them, read from the
    file's end); ``follow=true`` keeps streaming what is appended until the run ends."""
    # every file read in a worker thread: a large log or a slow disk never holds the event loop
    path = await asyncio.to_thread(sup.log_path, run_id, process)
    head, pos = await asyncio.to_thread(log_files.tail, path, lines)
    if not follow:
        return PlainTextResponse(head.decode(errors="replace"))

    async def stream() -> AsyncIterator[bytes]:
        nonlocal pos
        yield head
        while not await request.is_disconnected():
            chunk, pos = await asyncio.to_thread(log_files.read_new, path, pos)
            if chunk:
                yield chunk
                if len(chunk) == log_files.FOLLOW_CHUNK_BYTES:
                    continue  # more is waiting
            elif (await asyncio.to_thread(sup.journal.record, run_id))["state"] not in ACTIVE:
                return
            await asyncio.sleep(0.25)

    return StreamingResponse(stream(), media_type="text/plain; charset=utf-8")
