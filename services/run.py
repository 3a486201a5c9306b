"""The names of the run engine (:mod:`services.supervise`) under their older home, for code that
imports them from here (benchmarks, scripts)."""

from __future__ import annotations

from typing import Any

from services.supervise.config import (  # noqa: F401 (re-exported)
    CollatorSection,
    DataConfig,
    QueueSection,
    RunConfig,
    RunTrainerConfig,
    load_run_config,
    run_config_from_dict,
)
from services.supervise.driver import Driver
from services.supervise.plan import default_run_id  # noqa: F401 (re-exported)
from services.supervise.preflight import (  # noqa: F401 (re-exported)
    SMOLLM2_VOCAB,
    build_cached_projection,
    spec_vocab_size,
)

# The trainer projection of a run config that leaves it to the run to build: none is given
# (``RunTrainerConfig.projection_to_build``); the built file's path goes into the plan.
PENDING_PROJECTION = None


class Run(Driver):
    """:class:`services.supervise.driver.Driver` under its older name."""

    def _projection(self, s_tok: Any, t_tok: Any) -> Any:
        """The cached projection of the run's tokenizers, built first when missing."""
        return build_cached_projection(self.config, s_tok, t_tok)


def report(run_dir: Any) -> dict[str, Any]:
    """:func:`services.run_cli.report`."""
    from services.run_cli import report as _report

    return _report(run_dir)


def install_stop(run: Driver) -> None:
    """:func:`services.run_cli.install_stop`."""
    from services.run_cli import install_stop as _install_stop

    _install_stop(run)
