"""The thread that watches the runs' queues: stats of each, restarts and outages of shared ones.

Every ``interval_s`` one thread asks every active run's queue for its stats (the queue figures of
the API and /metrics, and each run's bounded history of them:
:class:`services.control.queue_history.QueueHistory`) and says hello to every shared queue; a run's
own thread acts on what it saw (:meth:`QueueMonitor.act`).

A run on a shared queue (``queue.address``) has no queue process: the monitor says hello to each
such address every ``interval_s`` (:class:`QueueWatch` keeps what each answer says). A server that
answers as another instance (``epoch``) than the run's processes started on restarted: event
``queue_restarted``; unless its hello says ``durable`` (``--data-dir``) it lost the run's samples,
and the run restarts as after a loss of its own queue
(:meth:`services.supervise.driver.Driver.restart_all`:
RECOVERING, every process again on the new instance, the trainers from their checkpoint, one
restart of the ``run`` budget). A shared queue that answers nothing for longer than the run's
``hang_after_s`` fails the run (event ``queue_unreachable``). A slow or dead queue delays only
these figures and looks, never a run's supervision.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from services.control.journal import Journal
from services.control.queue_watch import QueueWatch
from services.supervise.events import Failure

if TYPE_CHECKING:
    from services.control.live_run import LiveRun

logger = logging.getLogger(__name__)


class QueueMonitor:
    """The queue-stats thread and the watches of the shared queues.

    Args:
        runs: every run this control plane holds (called under ``lock``).
        journal: records the runs' queue events.
        lock: the supervisor's lock: guards the watches and each run's ``queue_news``.
        closing: set when the control plane shuts down.
        interval_s: seconds between two stats calls to each run's queue, and between two hellos
            to each shared queue.
    """

    def __init__(
        self,
        runs: Callable[[], list[LiveRun]],
        *,
        journal: Journal,
        lock: threading.RLock,
        closing: threading.Event,
        interval_s: float,
    ) -> None:
        self._runs = runs
        self.journal = journal
        self._lock = lock
        self._closing = closing
        self.interval_s = interval_s
        self._watches: dict[str, QueueWatch] = {}  # shared queue address -> its watch
        self._thread = threading.Thread(target=self._loop, name="queue-stats", daemon=True)

    def start(self) -> None:
        """Start the thread (it ends once ``closing`` is set)."""
        self._thread.start()

    def join(self, timeout_s: float) -> None:
        """Wait for the thread to end."""
        self._thread.join(timeout_s)

    # ------------------------------------------------------------------ the run threads' side

    def note_instance(self, h: LiveRun) -> None:
        """At each launch of a run on a shared queue (run thread): the instance its processes
        start on, the baseline of the next looks."""
        from services.queue.client import QueueClient

        address = h.run.queue_address
        hello: dict[str, Any] | None = None
        try:
            with QueueClient(
                address, timeout_s=2.0, retries=0, name="control", shm="never"
            ) as client:
                hello = client.hello()
        except Exception as e:
            logger.warning(
                "[control] run %s: queue %s gave no hello after the launch (%s); its next "
                "answer names the run's instance",
                h.run_id,
                address,
                e,
            )
        now = time.monotonic()
        with self._lock:
            watch = self._watches.setdefault(address, QueueWatch(address, now))
            if hello is not None:
                watch.answered(hello, now)
            watch.launched(h.run_id, hello.get("epoch") if hello is not None else None)
            h.restored_epoch = None
            h.queue_down_reported = False
            h.launches += 1

    def baseline(self, h: LiveRun) -> str | None:
        """The shared queue's instance the run's processes started on, as far as known."""
        with self._lock:
            watch = self._watches.get(h.run.queue_address)
            return watch.baseline(h.run_id) if watch is not None else None

    def forget(self, h: LiveRun) -> None:
        """The run ended: its watch keeps nothing of it."""
        with self._lock:
            watch = self._watches.get(h.run.queue_address)
            if watch is not None:
                watch.forget(h.run_id)

    def act(self, h: LiveRun) -> str | None:
        """Act on what the watch saw of the run's shared queue (run thread: a Run is driven by
        one thread only). A restart of a durable server is recorded; one of a server without
        ``--data-dir`` lost the run's samples: the run restarts as after the loss of a queue of
        its own (RECOVERING, budget ``run``). An outage past ``hang_after_s`` fails the run.

        Returns:
            ``failed`` when the run cannot go on (``run.failed`` says why), else None.
        """
        with self._lock:
            news, h.queue_news = h.queue_news, []
        run = h.run
        for kind, launches, *rest in news:
            if launches != h.launches:
                continue  # seen before the latest launch, which started on the new instance
            if kind == "unreachable":
                down_s, error = rest
                self.journal.event(
                    h.run_id,
                    "queue_unreachable",
                    {"address": run.queue_address, "down_s": round(down_s, 1), "error": error},
                )
                return run.fail(
                    Failure(
                        process="queue",
                        role="queue",
                        exit_code=None,
                        reason=(
                            f"queue {run.queue_address} unreachable for {down_s:.1f}s, more than "
                            f"the run's hang_after_s={run.config.hang_after_s:g}: start the queue "
                            "again on that address, then resume the run"
                        ),
                    )
                )
            old, new, durable = rest
            data = {
                "address": run.queue_address,
                "old_epoch": old,
                "new_epoch": new,
                "durable": durable,
            }
            if durable:
                data["action"] = (
                    "none: the queue is durable (--data-dir) and kept its samples; the run goes on"
                )
            elif run.restart_queued("run"):
                data["action"] = "none: a restart of the run is due; it starts on the new instance"
            else:
                data["action"] = "restart the run: the queue lost its samples" + (
                    ""
                    if durable is False
                    else " (its hello does not say whether it keeps them: treated as not durable)"
                )
            self.journal.event(h.run_id, "queue_restarted", data)
            logger.warning(
                "[control] run %s: queue %s restarted (instance %s -> %s); %s",
                h.run_id,
                run.queue_address,
                old,
                new,
                data["action"],
            )
            if not data["action"].startswith("restart"):
                continue
            # stops every process (a restart already queued is cancelled: the relaunch starts
            # its processes); poll_once relaunches them after the backoff
            if run.restart_all(f"queue restarted: epoch {old} -> {new}") == "failed":
                return "failed"
        return None

    # ------------------------------------------------------------------ the monitor's thread

    def _loop(self) -> None:
        """Hello to every shared queue of an active run (:meth:`_watch_shared`), then stats from
        every active run's queue, every ``interval_s``."""
        from services.queue.client import QueueClient

        clients: dict[str, Any] = {}
        hellos: dict[str, Any] = {}  # shared queue address -> its watch's client
        while not self._closing.wait(self.interval_s):
            with self._lock:
                runs = list(self._runs())
            live = [h for h in runs if h.alive()]
            down = self._watch_shared(live, hellos)
            for h in runs:
                address = h.run.queue_address
                alive = h in live
                client = clients.get(h.run_id)
                if client is not None and (not alive or client.address != address):
                    clients.pop(h.run_id).close()
                    client = None
                if not alive or not address or address in down:
                    continue
                try:
                    if client is None:
                        client = clients[h.run_id] = QueueClient(
                            address, timeout_s=1.0, retries=0, name="control", shm="never"
                        )
                    stats = client.stats()
                    if h.run.external_queue:
                        stats = own_stats(stats, f"{h.run.run_id}.")
                    h.queue_stats = stats
                    h.queue_stats_at = time.time()
                    h.queue_history.add(stats, h.queue_stats_at)
                    if h.alive():
                        h.queue_history.save_if_due(h.queue_stats_at)
                    else:  # it ended while asked: its thread's last write came before this
                        h.queue_history.save()
                except Exception as e:  # restarting or gone: keep the last figures
                    logger.debug("[control] run %s: queue stats: %s", h.run_id, e)
                    clients.pop(h.run_id, None)
                    if client is not None:
                        client.close()
        for client in [*clients.values(), *hellos.values()]:
            client.close()

    def _watch_shared(self, runs: list[LiveRun], clients: dict[str, Any]) -> set[str]:
        """Say hello to each shared queue of the active ``runs``, and hand each run's thread
        what changed (``queue_news``): its server answers as another instance than the run
        started on, or has answered nothing for longer than the run's ``hang_after_s``.

        Args:
            runs: the active runs.
            clients: address -> its QueueClient, kept across calls (a connection per address).

        Returns:
            The addresses that did not answer.
        """
        from services.queue.client import QueueClient

        by_address: dict[str, list[LiveRun]] = {}
        for h in runs:
            if h.run.external_queue and h.run.queue_address:
                by_address.setdefault(h.run.queue_address, []).append(h)
        for address in set(clients) - set(by_address):
            clients.pop(address).close()
        down: set[str] = set()
        for address, group in by_address.items():
            client = clients.get(address)
            if client is None:
                client = clients[address] = QueueClient(
                    address, timeout_s=1.0, retries=0, name="control-watch", shm="never"
                )
            hello: dict[str, Any] | None = None
            try:
                hello = client.hello()
            except Exception as e:  # dead, hung or restarting: the outage clock runs
                client.close()  # the next hello opens a new connection
                error = str(e)
                down.add(address)
            now = time.monotonic()
            with self._lock:
                watch = self._watches.setdefault(address, QueueWatch(address, now))
                if hello is not None:
                    watch.answered(hello, now)
                else:
                    watch.failed(error, now)
                for h in group:
                    self._look(h, watch, now)
        return down

    def _look(self, h: LiveRun, watch: QueueWatch, now: float) -> None:
        """What ``watch`` says of the run's shared queue, queued for its thread (under the lock)."""
        change = watch.change(h.run_id, h.restored_epoch)
        if watch.baseline(h.run_id) is not None:
            h.restored_epoch = None
        if change is not None:
            h.queue_news.append(("restarted", h.launches, *change, watch.durable))
        limit = h.run.config.hang_after_s
        down_s = watch.down_s(now)
        if down_s == 0.0:
            h.queue_down_reported = False
        elif limit is not None and down_s > limit and not h.queue_down_reported:
            h.queue_down_reported = True
            h.queue_news.append(("unreachable", h.launches, down_s, watch.error))


def own_stats(stats: dict[str, Any], prefix: str) -> dict[str, Any]:
    """A shared queue's stats as one run sees them: its partitions only (names starting with
    ``prefix``), samples, bytes and leases summed over them; the server's own totals under
    ``server`` (capacity and parked claims are the server's).

    Args:
        stats: the ``stats`` reply of the queue server.
        prefix: the run's partition prefix (``"<run id>."``).
    """
    parts = {k: v for k, v in (stats.get("partitions") or {}).items() if k.startswith(prefix)}
    leased = 0
    for part in parts.values():
        for task in (part.get("tasks") or {}).values():
            leased += int(task.get("leased") or 0)
    return {
        **stats,
        "partitions": parts,
        "samples": sum(int(p.get("samples") or 0) for p in parts.values()),
        "bytes_used": sum(int(p.get("bytes") or 0) for p in parts.values()),
        "leases": leased,
        "shared": True,
        "server": {k: stats.get(k) for k in ("samples", "bytes_used", "leases")},
    }
