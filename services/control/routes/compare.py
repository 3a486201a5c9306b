"""/v1/compare: several runs side by side (curves on three x axes, config differences)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Query

from services.control import compare
from services.control.deps import check_host, get_supervisor
from services.control.schemas import CompareOut, ErrorOut
from services.control.supervisor import Supervisor

router = APIRouter(prefix="/v1/compare", tags=["runs"], dependencies=[Depends(check_host)])


@router.get(
    "",
    response_model=CompareOut,
    responses={
        403: {"model": ErrorOut, "description": "a Host that is not allowed"},
        404: {"model": ErrorOut, "description": "one of the runs does not exist"},
        422: {"model": ErrorOut, "description": "no run, or too many"},
    },
)
def compare_runs(
    run: list[str] = Query(
        ..., description=f"run ids in the order to show them (1 to {compare.MAX_RUNS})"
    ),
    points: int = Query(
        compare.DEFAULT_POINTS,
        ge=2,
        le=compare.MAX_POINTS,
        description="the most steps per run (thinned evenly, the last one kept)",
    ),
    sup: Supervisor = Depends(get_supervisor),
) -> dict[str, Any]:
    """Each run's loss (total, KD, CE), tokens/s, memory and held-out bits/byte, with each
    point's step, tokens seen and seconds since the run's first record; and the config keys
    whose values differ between the runs (``run_dir`` left out)."""
    return sup.compare(run, max_points=points)
