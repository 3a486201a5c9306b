"""A run's own MPS daemon (``mps: true``): its GPU processes share each GPU kernel by kernel.

Without MPS the processes of one GPU take turns: the CUDA driver gives the GPU to one context at
a time, so the teacher's forward waits while the trainer's memory-bound kernels (the loss, the
optimizer) leave most of the GPU idle, and the other way round. Under an MPS control daemon the
processes become clients of one server and their kernels run side by side (one H100, 0.6B
student + 1.5B teacher, 1 x 4096: 1.049x the pipeline's tokens/s; benchmarks/results/
e2e_pipeline.md).

The run starts ``nvidia-cuda-mps-control -d`` with its pipe and log folders under
``RUN_DIR/mps/`` (so it is this run's daemon, not a machine-wide one), gives every GPU process
``CUDA_MPS_PIPE_DIRECTORY`` and ``CUDA_MPS_LOG_DIRECTORY``, and sends the daemon ``quit`` when
the run ends. The processes of the run must be on this machine (the local launcher).

The server sees the GPUs the daemon was started with and numbers them from 0: a run started
with ``CUDA_VISIBLE_DEVICES=2,3`` gives its clients ``0,1`` (the same ``2,3`` would name GPUs the
server does not have: "No CUDA GPUs are available"). A list of UUIDs is kept as it is.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from pathlib import Path

logger = logging.getLogger(__name__)

CONTROL = "nvidia-cuda-mps-control"
PIPE_ENV = "CUDA_MPS_PIPE_DIRECTORY"
LOG_ENV = "CUDA_MPS_LOG_DIRECTORY"
VISIBLE_ENV = "CUDA_VISIBLE_DEVICES"
# seconds a control command may take (starting the daemon, quit)
TIMEOUT_S = 30.0


def control_binary() -> str:
    """The MPS control program on PATH.

    Raises:
        ValueError: it is not installed (names the setting to turn off).
    """
    path = shutil.which(CONTROL)
    if path is None:
        raise ValueError(
            f"mps: true but {CONTROL} is not on PATH (it comes with the NVIDIA driver's "
            "utilities); install it, or set mps: false"
        )
    return path


def client_visible_devices(visible: str | None) -> str | None:
    """A client's ``CUDA_VISIBLE_DEVICES`` under a daemon started with ``visible``.

    Args:
        visible: the daemon's ``CUDA_VISIBLE_DEVICES`` (None: unset).

    Returns:
        ``"0,...,n-1"`` for a list of n indices (the server numbers its GPUs from 0), None where
        the client keeps what it inherits (unset or empty, or UUIDs, which name the same GPU in
        the server).
    """
    items = [d.strip() for d in (visible or "").split(",") if d.strip()]
    if not items or not all(d.isdigit() for d in items):
        return None
    return ",".join(str(i) for i in range(len(items)))


def mps_env(folder: str | os.PathLike[str], visible: str | None = None) -> dict[str, str]:
    """The variables that make a CUDA process a client of the daemon of ``folder``.

    Args:
        folder: the daemon's folder (``RUN_DIR/mps``).
        visible: the ``CUDA_VISIBLE_DEVICES`` the daemon starts with (see
            :func:`client_visible_devices`).
    """
    folder = Path(folder)
    env = {PIPE_ENV: str(folder / "pipe"), LOG_ENV: str(folder / "log")}
    client = client_visible_devices(visible)
    if client is not None:
        env[VISIBLE_ENV] = client
    return env


class MpsDaemon:
    """The MPS control daemon of one run.

    Args:
        folder: its pipe and log folders go here (``RUN_DIR/mps``).
    """

    def __init__(self, folder: str | os.PathLike[str]) -> None:
        self.env = mps_env(folder)
        self.started = False

    def _control(self, *args: str, command: str | None = None) -> subprocess.CompletedProcess:
        return subprocess.run(
            [control_binary(), *args],
            input=command,
            env={**os.environ, **self.env},
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
        )

    def running(self) -> bool:
        """A daemon answers on this run's pipe folder."""
        if not (Path(self.env[PIPE_ENV]) / "control").exists():
            return False
        try:
            return self._control(command="get_server_list\n").returncode == 0
        except (ValueError, subprocess.TimeoutExpired):  # no program, or a pipe left by a gone one
            return False

    def start(self) -> None:
        """Start the daemon, unless this run's is already up (a relaunch after a restart).

        Raises:
            ValueError: the control program is not installed.
            RuntimeError: it did not start (with its message).
        """
        for path in self.env.values():
            Path(path).mkdir(parents=True, exist_ok=True)
        if self.running():
            self.started = True
            return
        done = self._control("-d")
        if done.returncode != 0:
            raise RuntimeError(
                f"{CONTROL} -d failed (exit {done.returncode}): "
                f"{(done.stderr or done.stdout).strip()}; see {self.env[LOG_ENV]}/control.log"
            )
        self.started = True
        logger.info("[run] MPS daemon started (pipe folder %s)", self.env[PIPE_ENV])

    def stop(self) -> None:
        """Ask the daemon to quit (its clients have ended); nothing when none runs."""
        if not self.started and not self.running():
            return
        try:
            done = self._control(command="quit\n")
        except (ValueError, subprocess.TimeoutExpired) as e:
            logger.warning("[run] the MPS daemon did not quit: %s", e)
            return
        self.started = False
        if done.returncode != 0:
            logger.warning("[run] the MPS daemon did not quit: %s", done.stderr.strip())
