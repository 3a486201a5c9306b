"""The launcher protocol: what a run needs from a launcher (local subprocesses or Ray actors)."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from services.launch.spec import ProcessSpec


@runtime_checkable
class LaunchedProcess(Protocol):
    """One started process of a run, wherever it runs.

    Attributes:
        spec: the :class:`ProcessSpec` it was started from.
        pid: its process id on its host.
        host: the host name it runs on.
    """

    spec: ProcessSpec

    @property
    def pid(self) -> int:
        """The process id on :attr:`host`."""
        ...

    @property
    def host(self) -> str:
        """The host the process runs on."""
        ...

    def poll(self) -> int | None:
        """Exit code (negative: killed by that signal), or None while it runs."""
        ...

    def signal(self, signum: int) -> None:
        """Send ``signum`` to the process group (the process and whatever it started)."""
        ...

    def tail(self, lines: int = 20) -> str:
        """The last ``lines`` lines of its log."""
        ...


@runtime_checkable
class Launcher(Protocol):
    """Starts, watches and stops the processes of one run; knows only :class:`ProcessSpec`.

    Attributes:
        processes: name -> the process last started under that name.
    """

    processes: dict[str, Any]

    def start(self, spec: ProcessSpec) -> LaunchedProcess:
        """Start ``spec`` (``python -m services.cli <argv>``; ``--ready-file`` when it has one).

        Raises:
            ValueError: a process of that name runs, or the spec cannot be started as given.
        """
        ...

    def wait_ready(self, proc: Any, timeout_s: float) -> dict[str, Any]:
        """Wait for ``proc``'s ready file; returns its JSON.

        Raises:
            RuntimeError: it exited first, or was not ready within ``timeout_s``.
            ValueError: its spec has no ready file.
        """
        ...

    def stop(self, names: list[str] | None = None, grace_s: float = 30.0) -> dict[str, int | None]:
        """SIGTERM ``names`` (None: all), SIGKILL what is left after ``grace_s``; exit codes."""
        ...
