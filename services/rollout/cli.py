"""`xtoken rollout`: sample on-policy continuations with a copy of the student (flags generated
from RolloutConfig)."""

from __future__ import annotations

import argparse

from services.common import config as cfg
from services.common.flags import INTERNAL
from services.common.lifecycle import run_process


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of every RolloutConfig field, ``--config FILE``, ``--context FILE``, ``--ready-file``."""
    from services.rollout.config import RolloutConfig

    cfg.add_arguments(parser, RolloutConfig)
    # internal (hidden from --help): the ready handshake, {pid, worker} once the model is loaded
    parser.add_argument("--ready-file", default=None, help=INTERNAL)


def run(args: argparse.Namespace) -> int:
    """Build the config and run the rollout process."""
    from services.rollout.config import RolloutConfig
    from services.rollout.main import serve

    def main(lc):
        return serve(cfg.from_args(RolloutConfig, args), lc)

    return run_process("rollout", main, ready_file=args.ready_file, log_level=args.log_level)
