"""The one process lifecycle of every service: logging, stop on signal or parent death, ready file.

Every service process (queue, collator, teacher, trainer) runs its main through
:func:`run_process`::

    def main(lc: Lifecycle) -> int | None:
        server = Server(config)          # a ValueError here: exit code 2, message only
        lc.ready(endpoint=server.bind())   # ready file {"pid", "name", "endpoint"}; "[queue] ready"
        server.serve(stop=lc.stop)         # returns after lc.stop is set and the work is drained
        return 0

    sys.exit(run_process("queue", main, ready_file=args.ready_file))

What it does, once, for everyone:

* **Logging**: one root handler on stderr; every line names its component (``[queue] ...``;
  lines of library loggers get the prefix added).
* **Stop**: SIGTERM and SIGINT set ``lc.stop`` (a ``threading.Event``); main drains and returns.
  A second SIGINT (Ctrl-C twice) interrupts at once (exit code 130).
* **Dead-parent sentinel**: when the process has a supervising parent (``parent_pid`` or env
  ``XTOKEN_PARENT_PID``), Linux ``prctl(PR_SET_PDEATHSIG, SIGTERM)`` and a watcher thread set
  ``lc.stop`` when that parent dies, so no orphan outlives its run. Without a parent pid (a
  server started from a shell or as a container's PID 1) nothing watches the parent.
  PDEATHSIG fires when the parent *thread* that started the process exits: a launcher must
  start children from a thread that lives as long as they should (e.g. its main thread).
* **Ready handshake**: ``lc.ready(**info)`` writes the ready file atomically as JSON
  ``{"pid": ..., "name": ..., **info}`` (a launcher waits for it, see :func:`read_ready`); the
  file is removed when the process exits.
* **Heartbeat**: with env ``XTOKEN_HEARTBEAT_FILE`` (set per process by ``xtoken run`` and the
  control plane), a daemon thread rewrites that file every ``XTOKEN_HEARTBEAT_S`` seconds with
  the main loop's progress: main calls ``lc.progress()`` once per iteration of its loop (a step,
  a served request), and ``lc.waiting()`` once per round of a wait on a peer (a poll of the
  queue for a teacher's results), so a supervisor tells a hung main loop from a live one
  (:mod:`services.common.heartbeat`).
* **Exit-code file**: with env ``XTOKEN_EXIT_FILE`` (set per process by ``xtoken run`` and the
  control plane), the process writes ``{"pid": ..., "code": ...}`` there as it exits, so a
  supervisor that is not its parent (one re-attached after a restart) still learns the code
  (:func:`read_exit_code`). A process killed by a signal writes none.
* **Exit code**: what the outcome was, decided where it was checked:

  ====  ==================================================================================
  0     main returned (also after a stop by signal, once it drained)
  2     bad settings: a :class:`~xtoken_core.errors.SettingsError` (``ConfigError``
        included) whenever raised, or any ``ValueError`` raised before :meth:`Lifecycle.ready`
        (a check at start-up: settings or inputs found bad before work starts)
  3     bad data: a :class:`~xtoken_core.errors.DataError` whenever raised
  1     a fault: any other exception, and a ``ValueError`` raised once the process serves
        (a run's own file found damaged mid-run, a peer's bad reply): a restart may cure it
  ====  ==================================================================================

  2 and 3 are logged as ``[name] error: ...`` without a traceback (the message names the cause
  and the fix) and a supervisor never restarts them; 1 is logged with its traceback. An ``int``
  returned by main is passed through.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import pathlib
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

from services.common.heartbeat import Heartbeat
from xtoken_core.errors import EXIT_DATA, EXIT_SETTINGS, DataError, SettingsError

__all__ = [
    "EXIT_FILE_ENV",
    "PARENT_PID_ENV",
    "Lifecycle",
    "configure_logging",
    "pause_progress",
    "progress",
    "read_exit_code",
    "read_ready",
    "run_process",
    "waiting",
]

logger = logging.getLogger(__name__)

# Environment variable naming the supervising parent's pid (set by launchers).
PARENT_PID_ENV = "XTOKEN_PARENT_PID"
# Where the process writes its exit code as it exits (unset: nowhere).
EXIT_FILE_ENV = "XTOKEN_EXIT_FILE"
# Seconds between two checks of the parent by the watcher thread.
PARENT_POLL_S = 0.5
_PR_SET_PDEATHSIG = 1
_LOG_FORMAT = "%(asctime)s %(levelname)s %(message)s"
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


# ----------------------------------------------------------------------------- logging


class _ComponentFormatter(logging.Formatter):
    """Prefixes ``[name] `` to messages that do not start with a ``[component]`` tag."""

    def __init__(self, name: str) -> None:
        super().__init__(_LOG_FORMAT)
        self.component = name

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 (logging API)
        if not record.message.startswith("["):
            record.message = f"[{self.component}] {record.message}"
        return super().formatMessage(record)


def _parse_level(level: str | int) -> int:
    if isinstance(level, int) and not isinstance(level, bool):
        return level
    names = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
    text = str(level).strip().upper()
    if text not in names:
        raise ValueError(f"log level {level!r} is not known; use one of {', '.join(names)}")
    return getattr(logging, text)


def configure_logging(name: str, level: str | int = "INFO") -> None:
    """Log to stderr, every line tagged with its component.

    Replaces the format of a plain stderr/stdout handler already on the root logger (e.g. one
    from ``logging.basicConfig``) instead of adding a second one; leaves other handlers (files,
    pytest's capture) alone. Safe to call again (a new name or level).

    Args:
        name: the component (``queue``, ``collator``, ``teacher0``...).
        level: a level name (case-insensitive) or number.

    Raises:
        ValueError: an unknown level name (names the valid ones).
    """
    number = _parse_level(level)
    root = logging.getLogger()
    formatter = _ComponentFormatter(name)
    plain = [
        h
        for h in root.handlers
        if type(h) is logging.StreamHandler or getattr(h, "_xtoken_lifecycle", False)
    ]
    if not plain:
        handler = logging.StreamHandler(sys.stderr)
        handler._xtoken_lifecycle = True  # type: ignore[attr-defined]
        root.addHandler(handler)
        plain = [handler]
    for handler in plain:
        handler.setFormatter(formatter)
    root.setLevel(number)


# ----------------------------------------------------------------------------- ready file


def read_ready(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """Read a ready file written by :meth:`Lifecycle.ready` (for launchers and tests).

    Args:
        path: the ready file.

    Returns:
        ``{"pid": ..., "name": ..., **info}``, or None while the file does not exist yet.

    Raises:
        ValueError: the file exists but is not a ready file (it is written atomically, so this
            is a wrong path, not a half-written file).
    """
    try:
        text = pathlib.Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        data = None
    if not isinstance(data, dict) or "pid" not in data or "name" not in data:
        raise ValueError(f"{os.fspath(path)!r} is not a ready file: {text[:80]!r}")
    return data


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by someone else
        return True
    return True


def _getppid() -> int:
    """The parent pid as the main thread sees it.

    When a parent dies the kernel re-parents our threads one by one and sends PDEATHSIG after
    the first (the main thread): ``os.getppid()`` in another thread may still name the dead
    parent for a moment, ``/proc/self/stat`` (the main thread's) does not.
    """
    try:
        with open("/proc/self/stat", "rb") as f:
            return int(f.read().rpartition(b")")[2].split()[1])
    except (OSError, ValueError, IndexError):
        return os.getppid()


def _parent_pid_from_env() -> int | None:
    raw = os.environ.get(PARENT_PID_ENV, "").strip()
    if not raw:
        return None
    try:
        pid = int(raw)
    except ValueError:
        raise ValueError(
            f"{PARENT_PID_ENV}={raw!r} is not a process id; unset it or set the launcher's pid"
        ) from None
    return pid if pid > 1 else None


# ----------------------------------------------------------------------------- lifecycle


class Lifecycle:
    """Stop event, signal handlers, dead-parent sentinel and ready file of one process.

    Args:
        name: the component name used in logs and the ready file.
        ready_file: where :meth:`ready` writes its JSON (None: only log).
        parent_pid: the supervising process; None reads env ``XTOKEN_PARENT_PID`` (unset or
            <= 1: no parent is watched).
        parent_poll_s: seconds between two checks of the parent by the watcher thread.
        heartbeat: the process's heartbeat writer, started by :meth:`install` (None: none).

    Attributes:
        stop: set on SIGTERM/SIGINT, when the parent dies, or by :meth:`request_stop`.
        reason: why ``stop`` was set (``"SIGTERM"``, ``"SIGINT"``, ``"parent 123 died"``...),
            None while running.

    Raises:
        ValueError: a malformed ``XTOKEN_PARENT_PID``.
    """

    def __init__(
        self,
        name: str,
        *,
        ready_file: str | os.PathLike[str] | None = None,
        parent_pid: int | None = None,
        parent_poll_s: float = PARENT_POLL_S,
        heartbeat: Heartbeat | None = None,
    ) -> None:
        self.name = name
        self.heartbeat = heartbeat
        self.ready_file = pathlib.Path(ready_file) if ready_file else None
        self.parent_pid = parent_pid if parent_pid is not None else _parent_pid_from_env()
        self.parent_poll_s = parent_poll_s
        self.stop = threading.Event()
        self.reason: str | None = None
        self.ready_info: dict[str, Any] | None = None
        self._old_handlers: dict[int, Any] = {}
        self._closed = threading.Event()
        self._threads: list[threading.Thread] = []
        self._pipe: tuple[int, int] | None = None
        self._parent_gone: Callable[[], bool] = lambda: False
        self._sigints = 0

    # ------------------------------------------------------------------ install / close

    def install(self) -> Lifecycle:
        """Install the signal handlers (main thread only) and the dead-parent sentinel.

        Returns:
            self.
        """
        if self.ready_file is not None:
            self._remove_ready_file(only_ours=False)  # a stale file of an earlier run
        if threading.current_thread() is threading.main_thread():
            self._pipe = os.pipe()
            os.set_blocking(self._pipe[1], False)
            self._start_thread(self._signal_loop, "signal")
            for signum in _STOP_SIGNALS:
                self._old_handlers[signum] = signal.signal(signum, self._on_signal)
        else:
            logger.debug("[%s] not the main thread: no signal handlers", self.name)
        if self.parent_pid is not None:
            self._watch_parent()
        if self.heartbeat is not None:
            self.heartbeat.start()
        return self

    def close(self) -> None:
        """Restore the signal handlers, stop the helper threads, remove our ready file."""
        for signum, handler in self._old_handlers.items():
            signal.signal(signum, handler)
        self._old_handlers.clear()
        self._closed.set()
        if self._pipe is not None:
            os.write(self._pipe[1], b"\0")  # wakes the signal thread: exit
        for thread in self._threads:
            thread.join(timeout=2 * self.parent_poll_s + 1.0)
        self._threads.clear()
        if self._pipe is not None:
            for fd in self._pipe:
                os.close(fd)
            self._pipe = None
        if self.ready_file is not None:
            self._remove_ready_file(only_ours=True)
        if self.heartbeat is not None:
            self.heartbeat.close()

    def _start_thread(self, target: Callable[[], None], what: str) -> None:
        thread = threading.Thread(target=target, name=f"{self.name}-{what}", daemon=True)
        thread.start()
        self._threads.append(thread)

    def __enter__(self) -> Lifecycle:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ stop

    def request_stop(self, reason: str) -> None:
        """Set ``stop`` (once; the first reason is kept) and log it.

        Args:
            reason: what asked for the stop, for the log line.
        """
        if self.stop.is_set():
            return
        self.reason = reason
        logger.info("[%s] %s: stopping", self.name, reason)
        self.stop.set()

    def progress(self) -> None:
        """One iteration of the main loop is done (a step, a served request): the heartbeat
        shows a main loop that moves. Call it from the loop, not from a helper thread."""
        if self.heartbeat is not None:
            self.heartbeat.progress()

    def waiting(self) -> None:
        """The main loop waits on a peer in rounds that each return (a poll of the queue with a
        timeout): alive though no iteration completes (:meth:`Heartbeat.waiting`). Call it once
        per round, from the main loop."""
        if self.heartbeat is not None:
            self.heartbeat.waiting()

    def pause_progress(self) -> None:
        """The main loop leaves for a phase of unknown length (a checkpoint, an evaluation):
        the hang check waits for the next :meth:`progress`."""
        if self.heartbeat is not None:
            self.heartbeat.pause()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until ``stop`` is set or ``timeout`` seconds pass; returns ``stop.is_set()``."""
        return self.stop.wait(timeout)

    def _on_signal(self, signum: int, _frame: Any) -> None:
        if signum == signal.SIGINT:
            self._sigints += 1
            if self._sigints > 1:
                raise KeyboardInterrupt  # Ctrl-C twice: do not wait for the drain
        # The handler runs between two bytecodes of the main thread, which may hold the
        # Event's or a logging handler's lock right now: only a write to the self-pipe here;
        # the signal thread sets the event and logs.
        assert self._pipe is not None
        try:
            os.write(self._pipe[1], bytes([signum]))
        except BlockingIOError:  # the pipe is full of earlier signals: one is enough
            pass

    def _signal_loop(self) -> None:
        assert self._pipe is not None
        read_fd = self._pipe[0]
        while True:
            for signum in os.read(read_fd, 64):
                if signum == 0:
                    return
                name = signal.Signals(signum).name
                if signum == signal.SIGTERM and self._parent_gone():
                    name = f"parent {self.parent_pid} died ({name})"  # PR_SET_PDEATHSIG
                self.request_stop(name)

    # ------------------------------------------------------------------ parent sentinel

    def _watch_parent(self) -> None:
        parent = self.parent_pid
        assert parent is not None
        direct = parent == os.getppid()
        if direct and sys.platform == "linux":
            try:
                libc = ctypes.CDLL(None, use_errno=True)
                if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
                    logger.warning(
                        "[%s] prctl(PR_SET_PDEATHSIG) failed: errno %d; the watcher thread "
                        "still checks the parent",
                        self.name,
                        ctypes.get_errno(),
                    )
            except (OSError, AttributeError) as e:
                logger.warning(
                    "[%s] no prctl (%s); the watcher thread checks the parent", self.name, e
                )

        def parent_gone() -> bool:
            # A direct parent that died re-parents us (to init or a subreaper); any other pid
            # is checked for existence.
            return _getppid() != parent if direct else not _pid_alive(parent)

        self._parent_gone = parent_gone
        if parent_gone():  # died before the sentinel was set
            self.request_stop(f"parent {parent} died")
            return

        def watch() -> None:
            while not self._closed.wait(self.parent_poll_s):
                if parent_gone():
                    self.request_stop(f"parent {parent} died")
                    return

        self._start_thread(watch, "parent")

    # ------------------------------------------------------------------ ready

    def ready(self, **info: Any) -> dict[str, Any]:
        """Announce readiness: write the ready file (atomically) and log ``[name] ready``.

        Args:
            **info: JSON-able facts for the launcher (e.g. ``endpoint="tcp://..."``).

        Returns:
            The ready record ``{"pid": ..., "name": ..., **info}``.

        Raises:
            ValueError: ``info`` uses the reserved keys ``pid`` or ``name``.
            TypeError: a value is not JSON-able.
        """
        reserved = {"pid", "name"} & set(info)
        if reserved:
            raise ValueError(f"ready() info may not set {sorted(reserved)}: they are filled in")
        record = {"pid": os.getpid(), "name": self.name, **info}
        text = json.dumps(record, sort_keys=True)
        if self.ready_file is not None:
            self.ready_file.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.ready_file.with_name(f".{self.ready_file.name}.tmp{os.getpid()}")
            tmp.write_text(text + "\n", encoding="utf-8")
            os.replace(tmp, self.ready_file)
        self.ready_info = record
        details = ", ".join(f"{k}={v}" for k, v in info.items())
        logger.info("[%s] ready%s", self.name, f": {details}" if details else "")
        return record

    def _remove_ready_file(self, only_ours: bool) -> None:
        assert self.ready_file is not None
        try:
            if only_ours:
                record = read_ready(self.ready_file)
                if record is None or record.get("pid") != os.getpid():
                    return
            self.ready_file.unlink(missing_ok=True)
        except (OSError, ValueError) as e:
            logger.warning("[%s] could not remove ready file %s: %s", self.name, self.ready_file, e)


# ----------------------------------------------------------------------------- run_process

# The lifecycle of this process while run_process runs it (module-level progress()).
_current: Lifecycle | None = None


def progress() -> None:
    """:meth:`Lifecycle.progress` of this process's lifecycle (a no-op outside
    :func:`run_process`): for main loops that are not handed the lifecycle."""
    lc = _current
    if lc is not None:
        lc.progress()


def waiting() -> None:
    """:meth:`Lifecycle.waiting` of this process's lifecycle (a no-op outside
    :func:`run_process`)."""
    lc = _current
    if lc is not None:
        lc.waiting()


def pause_progress() -> None:
    """:meth:`Lifecycle.pause_progress` of this process's lifecycle (a no-op outside
    :func:`run_process`)."""
    lc = _current
    if lc is not None:
        lc.pause_progress()


def write_exit_code(code: int) -> None:
    """Write ``{"pid", "code"}`` atomically to the file env ``XTOKEN_EXIT_FILE`` names (if set);
    a failure to write is logged, never raised (the exit goes on)."""
    path = os.environ.get(EXIT_FILE_ENV)
    if not path:
        return
    try:
        target = pathlib.Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"pid": os.getpid(), "code": int(code)}))
        os.replace(tmp, target)
    except OSError as e:
        logger.warning("cannot write the exit code to %s: %s", path, e)


def read_exit_code(path: str | os.PathLike[str], pid: int | None = None) -> int | None:
    """The exit code a process wrote as it exited (:func:`write_exit_code`).

    Args:
        path: the exit-code file.
        pid: only a record of this process counts (None or 0: any).

    Returns:
        The code, or None (no file, unreadable, or another process's record).
    """
    try:
        record = json.loads(pathlib.Path(path).read_text())
        code = int(record["code"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if pid and record.get("pid") != pid:
        return None
    return code


def _value_error_code(error: ValueError, *, serving: bool) -> int:
    """The exit code of a ``ValueError`` that ended main: its class decides (settings 2, data
    3); any other is bad input at start-up (2) and a fault once the process serves (1)."""
    if isinstance(error, DataError):
        return EXIT_DATA
    if isinstance(error, SettingsError) or not serving:
        return EXIT_SETTINGS
    return 1


def run_process(
    name: str,
    main: Callable[[Lifecycle], int | None],
    *,
    ready_file: str | os.PathLike[str] | None = None,
    log_level: str | int = "INFO",
    parent_pid: int | None = None,
) -> int:
    """Run a service's main under the lifecycle and turn its outcome into an exit code.

    Args:
        name: the component name (logs, ready file).
        main: ``main(lifecycle) -> exit code or None``; it calls ``lifecycle.ready(...)`` once
            it serves, watches ``lifecycle.stop``, drains and returns.
        ready_file: where ``ready`` writes its JSON record (None: none).
        log_level: root logging level.
        parent_pid: the supervising process (None: env ``XTOKEN_PARENT_PID``, else none).

    Returns:
        The exit code: main's int (None -> 0; also 0 after a stop by signal once main
        returned); 2 for a :class:`~xtoken_core.errors.SettingsError`, or a ``ValueError``
        before main called ``ready``; 3 for a :class:`~xtoken_core.errors.DataError` (both
        ``[name] error: ...``, no traceback); 1 for any other exception, a ``ValueError`` once
        the process serves included (logged with its traceback); 130 when a second SIGINT
        interrupted the drain.
    """
    try:
        configure_logging(name, log_level)
        lifecycle = Lifecycle(
            name, ready_file=ready_file, parent_pid=parent_pid, heartbeat=Heartbeat.from_env(name)
        )
    except ValueError as e:  # the process's own settings (log level, environment)
        print(f"[{name}] error: {e}", file=sys.stderr, flush=True)
        write_exit_code(EXIT_SETTINGS)
        return EXIT_SETTINGS
    global _current
    lifecycle.install()
    _current = lifecycle
    logger.debug("[%s] started (pid %d)", name, os.getpid())
    try:
        code = main(lifecycle)
        code = 0 if code is None else int(code)
    except ValueError as e:
        code = _value_error_code(e, serving=lifecycle.ready_info is not None)
        if code == 1:
            logger.exception("[%s] failed: %s: %s", name, type(e).__name__, e)
        else:
            logger.error("[%s] error: %s", name, e)
            logger.debug("[%s] traceback of the error", name, exc_info=True)
    except KeyboardInterrupt:
        logger.warning("[%s] interrupted", name)
        code = 130
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int | None):
            logger.error("[%s] error: %s", name, e.code)
    except Exception as e:
        logger.exception("[%s] failed: %s: %s", name, type(e).__name__, e)
        code = 1
    finally:
        _current = None
        lifecycle.close()
    if lifecycle.stop.is_set():
        logger.info("[%s] stopped (%s), exit code %d", name, lifecycle.reason, code)
    else:
        logger.debug("[%s] exit code %d", name, code)
    write_exit_code(code)
    return code
