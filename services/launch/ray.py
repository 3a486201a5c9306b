"""Ray launcher: each process of a run is a Ray actor that starts the worker command as a
subprocess on its node, in a placement-group bundle with the spec's resources.

What runs where, and why:

* One actor per :class:`ProcessSpec`, in a placement group of one bundle that reserves the spec's
  ``resources`` (``gpu`` -> ``GPU``, ``cpu`` -> ``CPU``, default ``cpus_per_process``; any other
  key is a custom Ray resource). The actor holds the bundle, so Ray assigns it its GPUs.
* Colocation: the first process of a ``group`` is placed wherever Ray finds room; every later
  process of that group gets a bundle pinned (``ray.io/node-id`` label) to the same node: a
  teacher and the trainer ranks it serves share /dev/shm or a GPU's IPC handles.
* A unit of k ranks (a tensor-parallel teacher group: ``unit`` set, ``WORLD_SIZE`` k, one
  rendezvous) is reserved at once as its rank 0 starts: one placement group of k bundles (one
  per rank, each the spec's resources) under ``STRICT_PACK``, so Ray finds one node with room
  for every rank or places none, and rank i's actor takes bundle i. A unit never straddles
  nodes, and never half-starts on a node that has room for its first ranks only.
* The queue runs on the driver's node: the run (``Run``) talks to it at its loopback address.
* The actor starts ``python -m services.cli <argv>`` (its node's interpreter) in its own process
  group, writes stdout and stderr to ``spec.log_file`` on its node, reads the ready file there,
  forwards signals to the group and reports pid, host, the exit code (a SIGKILL shows as -9) and
  the exit time, stamped on the node by a thread of the actor that waits for the worker (the
  driver names the rank of a group that died first by it, not by the order it heard of them).
  The worker's supervising parent is the actor (``XTOKEN_PARENT_PID``): when the actor dies
  (driver gone, ``ray stop``), the worker stops too.
* torch.distributed: ``RANK``/``WORLD_SIZE``/``MASTER_PORT`` come from the spec;
  ``CUDA_VISIBLE_DEVICES`` is set to the GPUs Ray assigned to the actor and ``LOCAL_RANK`` to 0
  (the rank's one visible GPU); a loopback ``MASTER_ADDR`` is replaced by the IP of the node of
  rank 0 (same ``MASTER_PORT``) when the rank runs on another node.

On one node (a local cluster) every path of the spec is on the shared local disk. On several
nodes, the run directory (configs, checkpoints, metrics, logs) must be on storage every node
mounts at the same path, and the queue and rendezvous addresses must be routable (see the README).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from services.launch.base import Launcher, open_log, read_ready_file, tail_file, worker_command
from services.launch.spec import ProcessSpec

logger = logging.getLogger(__name__)

# poll() of a process whose actor is gone (its node died): the code is unknown. The same value
# as services.supervise.attach.EXIT_UNKNOWN, so a run treats both alike.
EXIT_LOST = -1000
# Driver environment variables that reach the workers (the actor's own environment is the
# raylet's, started by `ray start`, not the driver's).
FORWARD_ENV_PREFIXES = (
    "XTOKEN_",
    "HF_",
    "TRANSFORMERS_",
    "TOKENIZERS_",
    "OMP_",
    "MKL_",
    "TORCH_",
    "NCCL_",
    "GLOO_",
    "TRITON_",
)
PARENT_PID_ENV = "XTOKEN_PARENT_PID"  # services.common.lifecycle reads it in the worker
NODE_LABEL = "ray.io/node-id"
# Lines of a finished process's log kept after its actor is released.
KEPT_TAIL_LINES = 200


def _bundle(resources: dict[str, float], default_cpus: float) -> dict[str, float]:
    """A Ray bundle from a spec's resources (``gpu``/``cpu`` in any case; others as given).

    Raises:
        ValueError: a negative amount.
    """
    out: dict[str, float] = {}
    for key, amount in resources.items():
        name = {"gpu": "GPU", "cpu": "CPU"}.get(key.lower(), key)
        if amount < 0:
            raise ValueError(f"resources[{key!r}]={amount}: must be >= 0")
        if amount:
            out[name] = float(amount)
    out.setdefault("CPU", float(default_cpus))
    return out


def _unit_rank(spec: ProcessSpec) -> tuple[int, int]:
    """``(ranks of its unit, its rank)`` of a spec: a rank of a unit has ``unit`` set and
    torchrun's ``WORLD_SIZE`` / ``RANK``; any other process is ``(1, 0)``."""
    if spec.unit is None:
        return 1, 0
    size, rank = int(spec.env.get("WORLD_SIZE", "1")), int(spec.env.get("RANK", "0"))
    if not 0 <= rank < size:
        raise ValueError(
            f"{spec.name}: RANK={rank} is not below WORLD_SIZE={size} of its unit {spec.unit!r}"
        )
    return size, rank


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def forwarded_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The driver's variables that the workers get (names starting with
    :data:`FORWARD_ENV_PREFIXES`; never ``XTOKEN_PARENT_PID``)."""
    environ = dict(os.environ if environ is None else environ)
    return {
        k: v
        for k, v in environ.items()
        if k.startswith(FORWARD_ENV_PREFIXES) and k != PARENT_PID_ENV
    }


def _probe(address: str, timeout_s: float) -> None:
    """Fail fast when nothing listens at ``HOST:PORT`` (``auto``: the cluster ``ray start``
    recorded on this machine; ``ray://`` addresses are left to Ray).

    Raises:
        ValueError: a malformed address, or no answer within ``timeout_s``.
    """
    if "://" in address:
        return
    if address == "auto":  # what `ray start` on this machine recorded (Ray would wait forever)
        record = Path(os.environ.get("RAY_TMPDIR", "/tmp")) / "ray" / "ray_current_cluster"
        try:
            address = record.read_text().strip()
        except OSError:
            raise ValueError(
                "ray address auto: no Ray cluster was started on this machine (no "
                f"{record}); start one with `ray start --head --port PORT` or pass "
                "--ray-address HOST:PORT"
            ) from None
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(
            f"ray address {address!r} is not HOST:PORT; pass the head's address (`ray start "
            "--head --port PORT` prints it) or auto"
        )
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            pass
    except OSError as e:
        raise ValueError(
            f"cannot reach the Ray cluster at {address!r} ({e}); start one with `ray start "
            "--head --port PORT` and pass --ray-address HOST:PORT, or use --launcher local"
        ) from None


class WorkerActor:
    """Runs inside a Ray actor on the process's node: starts the worker subprocess, reports on it,
    signals it. Every method returns at once (the driver polls)."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = ProcessSpec(**spec)
        self.popen: subprocess.Popen | None = None
        self._log: Any = None
        self.exited_at: float | None = None
        self._reaped = threading.Event()

    def node(self) -> dict[str, Any]:
        """Where the actor runs: ``host``, ``node_ip``, ``node_id``, ``gpu_ids``."""
        ctx = ray.get_runtime_context()
        return {
            "host": socket.gethostname(),
            "node_ip": ray.util.get_node_ip_address(),
            "node_id": ctx.get_node_id(),
            "gpu_ids": [str(g) for g in ctx.get_accelerator_ids().get("GPU", [])],
        }

    def start(self, env: dict[str, str], cwd: str | None) -> int:
        """Start ``python -m services.cli <argv>`` in its own process group; returns its pid."""
        spec = self.spec
        self._log = open_log(spec)
        full_env = {**os.environ, **env}
        gpu_ids = [str(g) for g in ray.get_runtime_context().get_accelerator_ids().get("GPU", [])]
        if gpu_ids:
            full_env["CUDA_VISIBLE_DEVICES"] = ",".join(gpu_ids)
            if "LOCAL_RANK" in full_env:
                full_env["LOCAL_RANK"] = "0"  # the rank's GPU is device 0 of what it sees
        # The actor supervises the worker: a worker whose actor died stops (lifecycle sentinel).
        full_env[PARENT_PID_ENV] = str(os.getpid())
        if cwd is not None and not Path(cwd).is_dir():
            cwd = None
        self.popen = subprocess.Popen(
            worker_command(sys.executable, spec),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=full_env,
            cwd=cwd,
            start_new_session=True,
        )
        # waits only: the worker's dead-parent signal is tied to the thread that started it
        threading.Thread(target=self._reap, name="reap", daemon=True).start()
        return self.popen.pid

    def _reap(self) -> None:
        """Wait for the worker and stamp the moment it ended."""
        assert self.popen is not None
        try:
            self.popen.wait()
        finally:
            self.exited_at = time.time()
            self._reaped.set()

    def status(self) -> dict[str, Any]:
        """``code`` (None while running), ``exited_at`` (when it ended, seconds since the epoch
        on this node; None while running) and ``ready`` (the ready file's JSON, or None)."""
        assert self.popen is not None, "status() before start()"
        code = self.popen.poll()
        if code is not None and not self._reaped.wait(1.0) and self.exited_at is None:
            self.exited_at = time.time()  # no stamp: when it was found
        if code is not None and self._log is not None and not self._log.closed:
            self._log.close()
        ready = None
        if code is None and self.spec.ready_file:
            ready = read_ready_file(self.spec.ready_file)
        exited_at = self.exited_at if code is not None else None
        return {"code": code, "ready": ready, "exited_at": exited_at}

    def signal(self, signum: int) -> None:
        """Send ``signum`` to the worker's process group."""
        if self.popen is None:
            return
        try:
            os.killpg(self.popen.pid, signum)
        except ProcessLookupError:
            pass

    def tail(self, lines: int) -> str:
        """The last ``lines`` lines of the worker's log on this node."""
        return tail_file(self.spec.log_file, lines)


# max_concurrency=1: every call runs on the actor's main thread, the thread that started the
# worker, so the worker's PDEATHSIG fires only when the actor itself goes.
_RemoteWorker = ray.remote(max_restarts=0, max_concurrency=1)(WorkerActor)


class Placement:
    """A placement group of a run and the processes that hold its bundles: one process, or the
    ranks of a unit (bundle i: rank i). Removed from the cluster once the last holder leaves.

    Attributes:
        pg: the Ray placement group (ready).
        holders: names of the processes whose actors hold a bundle of it.
        taken: the bundle indices handed out (a bundle is never handed out twice: a rank started
            again gets a new placement group, with its unit).
        removed: the group was given back to the cluster.
    """

    def __init__(self, pg: Any) -> None:
        self.pg = pg
        self.holders: set[str] = set()
        self.taken: set[int] = set()
        self.removed = False

    def hold(self, name: str, index: int) -> None:
        """Hand bundle ``index`` to process ``name``."""
        assert index not in self.taken, f"bundle {index} handed out twice"
        self.taken.add(index)
        self.holders.add(name)

    def leave(self, name: str) -> None:
        """Process ``name`` gave back its bundle; the last one out removes the group."""
        self.holders.discard(name)
        if not self.holders and not self.removed:
            self.removed = True
            try:
                remove_placement_group(self.pg)
            except Exception as e:  # noqa: BLE001 (already gone is fine)
                logger.debug("[ray] remove placement group of %s: %s", name, e)


class RayProcess:
    """A process of a run started by :class:`RayLauncher` (driver side).

    Attributes:
        spec: its spec.
        node: ``host``, ``node_ip``, ``node_id``, ``gpu_ids`` of its actor.
        exited_at: when the worker ended (seconds since the epoch, stamped on its node; when the
            driver found it lost, for a lost actor), or None while it runs.
    """

    def __init__(
        self,
        spec: ProcessSpec,
        actor: Any,
        placement: Placement,
        bundle: int,
        node: dict[str, Any],
        pid: int,
        timeout_s: float,
    ) -> None:
        self.spec = spec
        self.node = node
        self.started = time.monotonic()
        self._actor = actor
        self._placement: Placement | None = placement
        self._bundle = bundle
        self._pid = pid
        self._timeout_s = timeout_s
        self._code: int | None = None
        self._tail = ""
        self.exited_at: float | None = None

    @property
    def pid(self) -> int:
        """The worker's process id on :attr:`host`."""
        return self._pid

    @property
    def host(self) -> str:
        """The host name of the node the worker runs on."""
        return str(self.node["host"])

    @property
    def bundle(self) -> tuple[Any, int] | None:
        """``(placement group, bundle index)`` its actor holds (the ranks of a unit share one
        group, rank i in bundle i), or None once it gave it back."""
        if self._placement is None:
            return None
        return self._placement.pg, self._bundle

    def _status(self) -> dict[str, Any]:
        if self._code is not None:
            return {"code": self._code, "ready": None}
        try:
            status = ray.get(self._actor.status.remote(), timeout=self._timeout_s)
        except (RayActorError, GetTimeoutError) as e:
            if isinstance(e, GetTimeoutError):
                logger.warning(
                    "[ray] %s: no answer from its actor in %.0fs", self.spec.name, self._timeout_s
                )
                return {"code": None, "ready": None}
            logger.warning(
                "[ray] %s: its actor is gone (%s): process lost", self.spec.name, type(e).__name__
            )
            self._code = EXIT_LOST
            self.exited_at = time.time()
            self.release()
            return {"code": self._code, "ready": None}
        if status["code"] is not None:
            self._code = int(status["code"])
            self.exited_at = status.get("exited_at") or time.time()
            self._tail = self._actor_tail(KEPT_TAIL_LINES)
            self.release()
        return status

    def poll(self) -> int | None:
        """Exit code (negative: killed by that signal; :data:`EXIT_LOST`: its node or actor is
        gone), or None while it runs."""
        return self._status()["code"]

    def ready(self) -> dict[str, Any] | None:
        """The ready file's JSON once the worker wrote it, else None."""
        return self._status()["ready"]

    def signal(self, signum: int) -> None:
        """Send ``signum`` to the worker's process group (through its actor)."""
        if self._code is not None:
            return
        try:
            ray.get(self._actor.signal.remote(int(signum)), timeout=self._timeout_s)
        except (RayActorError, GetTimeoutError) as e:
            logger.warning(
                "[ray] %s: signal %d not delivered (%s)", self.spec.name, signum, type(e).__name__
            )

    def tail(self, lines: int = 20) -> str:
        """The last lines of the worker's log (read on its node; kept once it ended)."""
        if self._code is None:
            return self._actor_tail(lines)
        return "\n".join(self._tail.splitlines()[-lines:])

    def _actor_tail(self, lines: int) -> str:
        try:
            return ray.get(self._actor.tail.remote(lines), timeout=self._timeout_s)
        except (RayActorError, GetTimeoutError):
            try:  # a run directory on shared storage still has it
                text = Path(self.spec.log_file).read_text(errors="replace")
            except OSError:
                return self._tail
            return "\n".join(text.splitlines()[-lines:])

    def release(self) -> None:
        """Kill the actor and give back its bundle (the worker has ended or is killed): its
        placement group is freed once no process of it holds a bundle."""
        if self._actor is not None:
            try:
                ray.kill(self._actor, no_restart=True)
            except Exception as e:  # noqa: BLE001 (already gone is fine)
                logger.debug("[ray] kill %s: %s", self.spec.name, e)
            self._actor = None
        if self._placement is not None:
            self._placement.leave(self.spec.name)
            self._placement = None


class RayLauncher(Launcher):
    """Start, watch and stop the processes of a run as Ray actors on a running cluster.

    Args:
        address: the cluster: ``HOST:PORT`` of its head (``ray start --head --port PORT``) or
            ``auto`` (the cluster started on this machine). The driver (this process) must run
            on a node of the cluster.
        cpus_per_process: logical CPUs a process reserves when its spec names none (its threads
            are not confined by it).
        place_timeout_s: seconds to wait for a bundle's resources before giving up.
        call_timeout_s: seconds to wait for an actor's answer.
        connect_timeout_s: seconds to wait for the head's port (Ray itself would retry for
            minutes).
        namespace: Ray namespace of the actors.

    Raises:
        ValueError: the cluster cannot be reached (names the address and the fix).
    """

    def __init__(
        self,
        address: str,
        cpus_per_process: float = 0.25,
        place_timeout_s: float = 120.0,
        call_timeout_s: float = 60.0,
        connect_timeout_s: float = 10.0,
        namespace: str = "xtoken",
    ) -> None:
        self.address = address
        self.cpus_per_process = cpus_per_process
        self.place_timeout_s = place_timeout_s
        self.call_timeout_s = call_timeout_s
        self.processes: dict[str, RayProcess] = {}
        self._groups: dict[str, str] = {}  # colocation group -> node id
        self._units: dict[str, Placement] = {}  # unit -> the placement group of its ranks
        if not ray.is_initialized():
            _probe(address, connect_timeout_s)
            try:
                ray.init(
                    address=address,
                    namespace=namespace,
                    log_to_driver=False,
                    logging_level=logging.WARNING,
                    configure_logging=False,
                )
            except (ConnectionError, RuntimeError, ValueError) as e:
                raise ValueError(
                    f"cannot reach the Ray cluster at {address!r} ({e}); start one with `ray "
                    "start --head --port PORT` and pass --ray-address HOST:PORT (this machine "
                    "must be a node of it), or use --launcher local"
                ) from None
        self.driver_node_id = ray.get_runtime_context().get_node_id()
        logger.info("[ray] connected to %s (driver node %s)", address, self.driver_node_id[:8])

    # ------------------------------------------------------------------ placement

    def _place(self, spec: ProcessSpec) -> tuple[Placement, int]:
        """The placement group and bundle index of ``spec``: a group of one bundle of its own,
        or for a rank of a unit its unit's group (reserved as the unit's rank 0 starts, with one
        bundle per rank) and the bundle of its rank.

        Raises:
            ValueError: the cluster cannot give the bundles within ``place_timeout_s``.
        """
        size, rank = _unit_rank(spec)
        if size == 1:
            placement, rank = Placement(self._reserve(spec, 1)), 0
        else:
            placement = self._units.get(str(spec.unit))
            if placement is None or placement.removed or rank == 0 or rank in placement.taken:
                placement = self._units[str(spec.unit)] = Placement(self._reserve(spec, size))
        placement.hold(spec.name, rank)
        return placement, rank

    def _reserve(self, spec: ProcessSpec, size: int) -> Any:
        """A ready placement group of ``size`` bundles of ``spec``'s resources on one node
        (``STRICT_PACK``), pinned to a node when it must be (its colocation group's, or the
        driver's for the queue).

        Raises:
            ValueError: the cluster cannot give the bundles within ``place_timeout_s``.
        """
        bundle = _bundle(spec.resources, self.cpus_per_process)
        node = None
        if spec.group is not None and spec.group in self._groups:
            node = self._groups[spec.group]
        elif spec.role == "queue":
            node = self.driver_node_id
        selector = [{NODE_LABEL: node}] * size if node else None
        pg = placement_group(
            [dict(bundle) for _ in range(size)],
            strategy="STRICT_PACK",
            name=f"xtoken-{spec.unit if size > 1 else spec.name}-{os.getpid()}",
            bundle_label_selector=selector,
        )
        try:
            ray.get(pg.ready(), timeout=self.place_timeout_s)
        except GetTimeoutError:
            remove_placement_group(pg)
            where = f" on node {node} (colocation group {spec.group!r})" if node else ""
            what = f"{bundle}" if size == 1 else f"{size} x {bundle} on one node (unit {spec.unit})"
            raise ValueError(
                f"cannot place {spec.name}: the cluster has no room for {what}{where} within "
                f"{self.place_timeout_s:.0f}s; `ray status` shows what is free: add nodes or "
                "resources, or lower the run's processes"
            ) from None
        return pg

    def _env(self, spec: ProcessSpec, node: dict[str, Any]) -> dict[str, str]:
        """The worker's extra environment: forwarded driver variables, the spec's, and a
        rendezvous address that reaches rank 0 across nodes."""
        env = {**forwarded_env(), **spec.env}
        addr, port = env.get("MASTER_ADDR"), env.get("MASTER_PORT")
        if addr and _is_loopback(addr) and env.get("RANK", "0") != "0":
            for other in self.processes.values():
                o = other.spec.env
                if (
                    other is not self.processes.get(spec.name)
                    and o.get("RANK") == "0"
                    and o.get("MASTER_PORT") == port
                    and other.poll() is None
                    and other.node["node_id"] != node["node_id"]
                ):
                    env["MASTER_ADDR"] = str(other.node["node_ip"])
        return env

    # ------------------------------------------------------------------ the launcher protocol

    def start(self, spec: ProcessSpec) -> RayProcess:
        """Place ``spec``, start its actor and the worker in it.

        Raises:
            ValueError: a process of that name is running, the spec has no log file, the
                cluster has no room for it, or its actor could not start the worker (names
                the cause and the fix).
        """
        self.check_startable(spec)
        placement, index = self._place(spec)
        bundle = _bundle(spec.resources, self.cpus_per_process)
        options: dict[str, Any] = {
            "num_cpus": bundle.get("CPU", 0),
            "num_gpus": bundle.get("GPU", 0),
            "scheduling_strategy": PlacementGroupSchedulingStrategy(placement.pg, index),
        }
        custom = {k: v for k, v in bundle.items() if k not in ("CPU", "GPU")}
        if custom:
            options["resources"] = custom
        actor = _RemoteWorker.options(**options).remote(dataclasses.asdict(spec))
        try:
            node = ray.get(actor.node.remote(), timeout=self.place_timeout_s)
            env = self._env(spec, node)
            pid = ray.get(actor.start.remote(env, os.getcwd()), timeout=self.call_timeout_s)
        except Exception as e:
            ray.kill(actor, no_restart=True)
            placement.leave(spec.name)
            raise ValueError(
                f"could not start {spec.name} under Ray ({type(e).__name__}: {e}); every node "
                "needs xtoken installed (with the ray extra) in the Python that runs `ray start`"
            ) from e
        if spec.group is not None:
            self._groups.setdefault(spec.group, node["node_id"])
        proc = RayProcess(spec, actor, placement, index, node, pid, self.call_timeout_s)
        self.processes[spec.name] = proc
        logger.info(
            "[run] started %s (pid %d on %s, ray node %s%s): xtoken %s",
            spec.name,
            pid,
            node["host"],
            node["node_id"][:8],
            f", GPUs {','.join(node['gpu_ids'])}" if node["gpu_ids"] else "",
            " ".join(spec.argv),
        )
        return proc

    def ready(self, proc: Any) -> dict[str, Any] | None:
        """``proc``'s ready file (read on its node) once its worker wrote it, else None."""
        return proc.ready()

    def log_place(self, proc: Any) -> str:
        """``HOST:PATH`` of ``proc``'s log (on its node)."""
        return f"{proc.host}:{proc.spec.log_file}"

    def close(self) -> None:
        """Stop every process and release every actor and placement group (the cluster stays)."""
        self.stop(grace_s=10)
        for p in self.processes.values():
            p.release()
