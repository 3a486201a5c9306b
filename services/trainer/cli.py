"""`xtoken trainer`: one trainer rank (torchrun-compatible; flags generated from TrainerConfig)."""

from __future__ import annotations

import argparse

from services.common import config as cfg
from services.common.flags import INTERNAL
from services.common.lifecycle import run_process


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of every TrainerConfig field, ``--config FILE`` and ``--ready-file``."""
    from services.trainer.config import TrainerConfig

    cfg.add_arguments(parser, TrainerConfig)
    # internal (hidden from --help): the ready handshake, {pid, rank} once ready
    parser.add_argument("--ready-file", default=None, help=INTERNAL)


def run(args: argparse.Namespace) -> int:
    """Build the config and run this trainer rank."""
    import os

    from services.trainer.config import TrainerConfig
    from services.trainer.main import serve

    def main(lc):
        return serve(cfg.from_args(TrainerConfig, args), lc)

    return run_process(
        f"trainer{os.environ.get('RANK', '0')}",
        main,
        ready_file=args.ready_file,
        log_level=args.log_level,
    )
