"""`xtoken teacher`: serve teacher logits to trainers (flags generated from TeacherConfig)."""

from __future__ import annotations

import argparse

from services.common import config as cfg
from services.common.flags import INTERNAL
from services.common.lifecycle import run_process


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of every TeacherConfig field, ``--config FILE``, ``--context FILE``, ``--ready-file``."""
    from services.teacher.config import TeacherConfig

    cfg.add_arguments(parser, TeacherConfig)
    # internal (hidden from --help): the ready handshake, {pid, instance} once serving
    parser.add_argument("--ready-file", default=None, help=INTERNAL)


def run(args: argparse.Namespace) -> int:
    """Build the config and run the teacher process (one rank of a group under torchrun)."""
    import os

    from services.teacher.config import TeacherConfig
    from services.teacher.main import serve

    def main(lc):
        return serve(cfg.from_args(TeacherConfig, args), lc)

    ready_file = args.ready_file
    if os.environ.get("RANK", "0") != "0":
        # torchrun gives every rank of a tensor-parallel group the same command and environment:
        # rank 0 speaks for the group (ready file, heartbeat, exit code)
        ready_file = None
        for name in ("XTOKEN_HEARTBEAT_FILE", "XTOKEN_EXIT_FILE"):
            os.environ.pop(name, None)
    return run_process("teacher", main, ready_file=ready_file, log_level=args.log_level)
