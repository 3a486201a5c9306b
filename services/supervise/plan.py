"""The plan of a run: from its config and settled inputs to each process's own section and the
process specs a launcher starts. Pure: nothing here writes a file or starts a process.

Each process gets only its own section (``run_dir/config/<process>.json``: its config class,
less the fields marked ``context``, with the fields marked ``derived`` computed here from their
one source) and the run's shared context (``run_dir/config/context.json``, written once); its
argv only names the two files. Nothing computed here is written back into the run config.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from pathlib import Path
from typing import Any

from services.collator.config import CollatorConfig, CorpusConfig
from services.common import config as cfgmod
from services.common.context import CONTEXT_FILE, Context, Shared
from services.common.heartbeat import HEARTBEAT_ENV, HEARTBEAT_S_ENV
from services.launch.spec import ProcessSpec
from services.protocol.names import policy_dir
from services.queue.config import ServerConfig
from services.rollout.config import RolloutConfig
from services.supervise.config import RunConfig, is_run_key, run_config_to_dict, value_at
from services.supervise.layout import Layout, plan_layout, run_transport
from services.supervise.mps import mps_env
from services.supervise.preflight import Inputs, slug
from services.teacher.config import TeacherConfig
from services.trainer.config import TrainerConfig


def default_run_id(run_dir: Path) -> str:
    """The id of a run started without one (``xtoken run``): its directory's name and a hash of
    its absolute path (two runs named alike in different places differ)."""
    digest = hashlib.sha1(str(run_dir).encode()).hexdigest()[:8]
    return f"{slug(run_dir.name)}-{digest}"


@dataclasses.dataclass(frozen=True)
class RunPlace:
    """Where a run lives and how it names itself on its queue.

    Attributes:
        run_dir: the run directory (absolute).
        run_id: the run's id.
        external_queue: the address of a running queue the run uses (``queue.address``), or None
            for a queue of its own.
        partition: the samples' partition: on an external queue every partition of the run
            (samples, teacher requests, end of data) starts with ``"<run id>."``, so two runs
            there never see each other's samples.
    """

    run_dir: Path
    run_id: str
    external_queue: str | None
    partition: str

    @classmethod
    def of(cls, config: RunConfig, run_id: str | None = None) -> RunPlace:
        """The place of ``config`` (``run_id`` None: :func:`default_run_id`)."""
        run_dir = Path(config.run_dir).resolve()
        run_id = run_id or default_run_id(run_dir)
        external = config.queue.address
        partition = f"{run_id}.{config.partition}" if external else config.partition
        return cls(run_dir, run_id, external, partition)


@dataclasses.dataclass(frozen=True)
class Host:
    """What the plan needs to know of the machine: GPUs to spread teachers over, cores to share
    among CPU processes.

    Attributes:
        gpus: CUDA devices visible; None: counted when a teacher needs to know.
        cores: cores this process may use.
        threads_set: ``OMP_NUM_THREADS`` is set already (the plan leaves it alone).
    """

    gpus: int | None = None
    cores: int = 1
    threads_set: bool = False

    @classmethod
    def here(cls) -> Host:
        """This machine."""
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        return cls(None, cores or 1, "OMP_NUM_THREADS" in os.environ)


@dataclasses.dataclass(frozen=True)
class Plan:
    """One launch of a run: every process's section and spec.

    Attributes:
        place: the run's :class:`RunPlace`.
        queue: the queue address every process connects to.
        master_port: the trainer ranks' rendezvous port.
        shared: the run-wide :class:`~services.common.context.Context` as a JSON mapping
            (``config/context.json``).
        sections: file stem (``queue``, ``collator``, ``trainer``, ``teacher0``) -> that
            process's own section as a JSON mapping.
        run_section: the whole run config with its settled inputs (``config/run.json``): its
            own keys, without the fields the run sets.
        specs: the processes, in start order (the queue first when the run has its own).
    """

    place: RunPlace
    queue: str
    master_port: int
    shared: dict[str, Any]
    sections: dict[str, dict[str, Any]]
    run_section: dict[str, Any]
    specs: tuple[ProcessSpec, ...]


def make_plan(
    config: RunConfig,
    inputs: Inputs,
    place: RunPlace,
    *,
    queue: str,
    master_port: int,
    host: Host | None = None,
) -> Plan:
    """Plan one launch of a run.

    Args:
        config: the run config (not modified).
        inputs: its settled inputs (:func:`services.supervise.preflight.preflight`, or
            :meth:`Inputs.given` for a config that names them all).
        place: the run's :class:`RunPlace`.
        queue: the queue address.
        master_port: the trainer ranks' rendezvous port.
        host: the machine (default: :meth:`Host.here`).

    Raises:
        ValueError: a section that does not build (a loss that needs a projection and has none).
    """
    host = host or Host.here()
    context = make_context(config, place, queue=queue)
    sections = {
        **make_data_sections(config, inputs, place, context),
        **make_sections(config, inputs, context, gpus=host.gpus),
    }
    if config.on_policy:
        sections.update(rollout_sections(config, inputs, place, context, gpus=host.gpus))
    run_section = run_config_to_dict(config)
    run_section["data"].update(train=inputs.train, heldout=inputs.heldout)
    run_section["trainer"]["loss"]["projection"] = inputs.projection
    for entry, projection in zip(run_section["extra_teachers"], inputs.extra_projections):
        entry["projection"] = projection
    specs = make_specs(config, place, master_port=master_port, host=host)
    shared = cfgmod.to_dict(context)
    return Plan(place, queue, master_port, shared, sections, run_section, tuple(specs))


def make_context(config: RunConfig, place: RunPlace, *, queue: str) -> Context:
    """The run-wide values every process of a launch on ``queue`` shares: the run config's
    shared settings (:class:`~services.common.context.Shared`) as the launch settles them."""
    values = {f.name: getattr(config, f.name) for f in dataclasses.fields(Shared)}
    values.update(run_dir=str(place.run_dir), partition=place.partition)
    return Context(**values, queue=queue)


def own(
    cls: type,
    section: Any,
    context: Context,
    *,
    over_context: dict[str, Any] | None = None,
    **derived: Any,
) -> dict[str, Any]:
    """A process's section file: the fields of ``cls`` taken from its run-config ``section`` (of
    ``cls`` or a run-facing subclass of it) and the values the run derives for it, less the
    fields the shared context gives; checked as the process builds it, with ``context``.

    Args:
        cls: the process's config class.
        section: its section of the run config.
        context: the launch's shared context.
        over_context: values of fields marked ``context`` that this process has its own of
            (a further teacher's ``tokenizer``): written into its section, over the context's.
        derived: the values the run sets, by field name or by the dotted key of a field of a
            nested section (``**{"teacher.groups": 2}``).

    Raises:
        ValueError: a section the process would refuse (names the key).
    """
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    data = {k: v for k, v in cfgmod.to_dict(section).items() if k in names}
    for key, value in derived.items():
        *parents, name = key.split(".")
        node = data
        for part in parents:
            node = node[part]
        node[name] = _plain(value)
    data = cfgmod.without_marked(cls, data)
    data.update(over_context or {})
    cfgmod.from_dict(cls, cfgmod.with_context(cls, data, context))
    return data


def _plain(value: Any) -> Any:
    """A derived value as its section file holds it (a section, or a list of them, as JSON)."""
    if dataclasses.is_dataclass(value):
        return cfgmod.to_dict(value)
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def copies(config: RunConfig, cls: type) -> dict[str, Any]:
    """The fields of ``cls`` (those of its nested sections by their dotted keys) whose
    ``derived`` mark names a key of the run config, with that key's value (the trainer's
    ``teacher.groups`` <- ``teachers``)."""
    return {
        key: value_at(config, source)
        for key, source in cfgmod.marks(cls, "derived").items()
        if is_run_key(source)
    }


def make_data_sections(
    config: RunConfig, inputs: Inputs, place: RunPlace, context: Context
) -> dict[str, dict[str, Any]]:
    """The section of the run's own queue (none on an external one) and of its collator: the
    corpus as the preflight settled it (the demo's when ``data.train`` is unset; its limit
    lowered when the held-out texts are its last ones)."""
    cfg = config
    out: dict[str, dict[str, Any]] = {}
    if not place.external_queue:
        out["queue"] = own(ServerConfig, cfg.queue, context)
    limit = cfg.data.limit if inputs.train_limit is None else inputs.train_limit
    corpus = own(CorpusConfig, cfg.data, context, train=inputs.train, limit=limit or None)
    # the further teachers' tokenizers: every sample carries each teacher's tokens
    extra = [e.tokenizer for e in cfg.extra_teachers]
    # each teacher's cache (or none): the collator puts the cached targets beside the fields
    caches = [v.cache for v in cfg.teacher_list()] if cfg.data.teacher_cache else []
    out["collator"] = own(
        CollatorConfig,
        cfg.collator,
        context,
        data=corpus,
        **{
            "worker.extra_teachers": extra,
            "worker.teacher_cache": caches,
            "worker.teacher_cache_missing": cfg.data.teacher_cache_missing,
        },
    )
    return out


def make_sections(
    config: RunConfig,
    inputs: Inputs,
    context: Context,
    *,
    gpus: int | None = None,
) -> dict[str, dict[str, Any]]:
    """The section of the trainer ranks (``trainer``) and of each teacher group (``teacher<g>``;
    ``t<j>.teacher<g>`` of the run's teacher j >= 1, an entry of ``extra_teachers``): without the
    run-wide values (:func:`make_context`), which every process reads from the shared context.
    The rollout workers' sections: :func:`rollout_sections`.

    Raises:
        ValueError: a trainer section that does not build (names the key).
    """
    cfg = config
    teacher, tr = cfg.teacher, cfg.trainer
    uses = tr.loss.uses_teacher
    hidden = uses and run_transport(cfg) == "hidden" and cfg.teacher_list()[0].live
    derived: dict[str, Any] = {
        **copies(cfg, TrainerConfig),
        "loss.projection": inputs.projection,
        "eval.heldout": inputs.heldout,
        "student.max_length": tr.student.max_length or cfg.ctx_student,
        # the hidden transport: the trainer applies the teacher's output layer, of its model
        "teacher.model": tr.teacher.model or (teacher.model if hidden else None),
        "extra_teachers": extra_links(cfg, inputs),
        "teacher.cache": cfg.teacher_list()[0].cache,
    }
    trainer = own(TrainerConfig, tr, context, **derived)  # checked: every projection is there
    out = {"trainer": trainer}
    layout = _layout(cfg, gpus)
    for view in cfg.teacher_list():
        if not view.live:  # its targets come from its cache alone: no teacher process
            continue
        t = view.section
        placed = layout.teacher(view.index)
        for g in range(view.groups):
            device = t.device
            if placed:  # one GPU: named; a tensor-parallel rank: cuda:LOCAL_RANK
                device = f"cuda:{placed[g][0]}" if t.tensor_parallel == 1 else "cuda"
            out[view.name(g)] = own(
                TeacherConfig,
                t,
                context,
                over_context={"tokenizer": view.tokenizer} if view.index else None,
                **{
                    **copies(cfg, TeacherConfig),
                    "teacher": view.index,
                    "group": g,
                    "device": device,
                    "transport": run_transport(cfg, t),
                    # only the first group of the first teacher evaluates the held-out text
                    "heldout": inputs.heldout if view.index == 0 and g == 0 else None,
                },
            )
    return out


def extra_links(config: RunConfig, inputs: Inputs) -> list[dict[str, Any]]:
    """The trainer's link to each further teacher (its ``extra_teachers`` entries): the
    teacher's tokenizer, weight, projection (as the pre-flight settled it), groups, preset vocab
    and seed, its model where the trainer applies its output layer (the hidden transport), and
    the waits and checks of ``trainer.teacher``, which the run gives every teacher's link."""
    link = config.trainer.teacher
    out = []
    views = config.teacher_list()[1:]
    projections = inputs.extra_projections or tuple(v.projection for v in views)
    for view, projection in zip(views, projections, strict=True):
        e = view.section
        hidden = run_transport(config, e) == "hidden" and view.live
        out.append(
            {
                "tokenizer": view.tokenizer,
                "weight": e.weight,
                "projection": projection,
                "model": e.model if hidden else None,
                "vocab_size": e.vocab_size,
                "seed": e.seed,
                "groups": view.groups,
                "timeout_s": link.timeout_s,
                "dead_after_s": link.dead_after_s,
                "verify_logits": link.verify_logits,
                "cache": view.cache,
                "cache_missing": config.data.teacher_cache_missing,
            }
        )
    return out


def rollout_sections(
    config: RunConfig,
    inputs: Inputs,
    place: RunPlace,
    context: Context,
    *,
    gpus: int | None = None,
) -> dict[str, dict[str, Any]]:
    """The section of each rollout worker (``rollout<i>``): its index, the student (the
    trainer's spec, vocab and seed), the trainer's weights directory, the prompts (``data.train``
    and its limit unless ``rollout.prompts``), and, unless ``rollout.max_pending`` is set, a step
    of on-policy samples of every rank (at least a batch) waiting at most: the trainers claim a
    step ahead, and more would only grow stale. The queue, partition, tokenizers, context
    lengths and run directory come from the shared context."""
    cfg, r = config, config.rollout
    tr = cfg.trainer
    per_step = tr.feed.step_samples * cfg.trainers
    share = max(1, round(cfg.data.on_policy_fraction * per_step))
    own_prompts = r.prompts is not None
    corpus_limit = cfg.data.limit if inputs.train_limit is None else inputs.train_limit
    out = {}
    for i in range(cfg.rollouts):
        device = r.device
        if device == "cuda":
            gpus = _gpu_count() if gpus is None else gpus
            device = f"cuda:{i % max(1, gpus)}"
        out[f"rollout{i}"] = own(
            RolloutConfig,
            r,
            context,
            **copies(cfg, RolloutConfig),
            worker=i,
            device=device,
            weights=str(policy_dir(place.run_dir)),
            state_dir=str(place.run_dir / "rollout"),
            prompts=r.prompts if own_prompts else inputs.train,
            limit=r.limit if own_prompts else corpus_limit,
            text_field=r.text_field if own_prompts else cfg.data.text_field,
            max_pending=max(r.batch, share) if r.max_pending is None else r.max_pending,
        )
    return out


def make_specs(
    config: RunConfig,
    place: RunPlace,
    *,
    master_port: int,
    host: Host | None = None,
) -> list[ProcessSpec]:
    """The processes of one launch: the queue (unless external), the collator (unless every
    sample is on-policy), a teacher per group (when the loss uses one; none for a teacher that
    ``data.teacher_cache`` serves, unless ``data.teacher_cache_missing`` is ``online``), a
    trainer per rank and the rollout workers (with on-policy samples), each with its heartbeat
    file (and, with ``mps: true``, each GPU process with the run's MPS daemon's folders). Each
    one's argv names its section file and the shared context, and nothing else."""
    cfg = config
    host = host or Host.here()
    d = place.run_dir

    def argv(command: list[str], section: str) -> list[str]:
        config_dir = d / "config"
        return [
            *command,
            "--config",
            str(config_dir / f"{section}.json"),
            "--context",
            str(config_dir / CONTEXT_FILE),
        ]

    specs = []
    if not place.external_queue:
        specs.append(
            ProcessSpec(
                "queue",
                "queue",
                argv(["queue", "serve"], "queue"),
                log_file=str(d / "logs" / "queue.log"),
                ready_file=str(d / "ready" / "queue"),
            )
        )
    collators = [
        ProcessSpec(
            "collator",
            "collator",
            argv(["collator"], "collator"),
            log_file=str(d / "logs" / "collator.log"),
        ),
    ]
    if cfg.data.on_policy_fraction < 1.0:  # every sample on-policy: no collator to read
        specs += collators
    views = [v for v in cfg.teacher_list() if v.live] if cfg.trainer.loss.uses_teacher else []
    rollouts = cfg.rollouts if cfg.on_policy else 0
    threads = process_threads(
        host,
        sum(v.groups * v.section.tensor_parallel for v in views),
        cfg.trainers,
        rollouts,
    )
    layout = _layout(cfg, host.gpus)
    for view in views:
        t, k = view.section, view.section.tensor_parallel
        placed = layout.teacher(view.index)
        for g in range(view.groups):
            unit = view.name(g)  # teacher0; t1.teacher0 for the run's teacher 1
            for i in range(k):
                name = unit if i == 0 else f"{unit}.{i}"
                env = dict(threads)
                if k > 1:  # torchrun's environment; the driver sets MASTER_PORT as the unit starts
                    env.update(RANK=str(i), WORLD_SIZE=str(k), MASTER_ADDR="127.0.0.1")
                    if placed:
                        env["LOCAL_RANK"] = str(placed[g][i])
                specs.append(
                    ProcessSpec(
                        name,
                        "teacher",
                        argv(["teacher"], unit),
                        env=env,
                        log_file=str(d / "logs" / f"{name}.log"),
                        # rank 0 speaks for its group (ready file, heartbeat, exit code)
                        ready_file=str(d / "ready" / name) if i == 0 else None,
                        resources=_resources(t.device, t.resources),
                        # beside the ranks it serves (a ring: rank r is in group r % teachers),
                        # or by its resources (the queue)
                        group=unit if cfg.apart(t) else str(g % cfg.teachers),
                        unit=unit if k > 1 else None,
                    )
                )
    for r in range(cfg.trainers):
        env = {
            "RANK": str(r),
            "WORLD_SIZE": str(cfg.trainers),
            # the rank's GPU (cuda:LOCAL_RANK): trainer.gpus[r], else GPU r
            "LOCAL_RANK": str(layout.trainer_gpus[r] if layout.trainer_gpus else r),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(master_port),
            **threads,
        }
        specs.append(
            ProcessSpec(
                f"trainer{r}",
                "trainer",
                argv(["trainer"], "trainer"),
                env=env,
                log_file=str(d / "logs" / f"trainer{r}.log"),
                ready_file=str(d / "ready" / f"trainer{r}"),
                resources=_resources(cfg.trainer.compute.device, cfg.trainer.resources),
                group=str(r % cfg.teachers),
            )
        )
    for i in range(rollouts):
        specs.append(
            ProcessSpec(
                f"rollout{i}",
                "rollout",
                argv(["rollout"], f"rollout{i}"),
                env=dict(threads),
                log_file=str(d / "logs" / f"rollout{i}.log"),
                ready_file=str(d / "ready" / f"rollout{i}"),
                resources={"gpu": 1} if cfg.rollout.device.startswith("cuda") else {},
                # beside trainer rank 0, which publishes the weights (shm / cuda_ipc: one node)
                group="0",
            )
        )
    for spec in specs:
        spec.env[HEARTBEAT_ENV] = str(d / "heartbeat" / spec.name)
        spec.env[HEARTBEAT_S_ENV] = str(cfg.heartbeat_s)
        if cfg.mps and spec.resources.get("gpu"):  # a client of the run's MPS daemon
            spec.env.update(mps_env(d / "mps", os.environ.get("CUDA_VISIBLE_DEVICES")))
    return specs


def process_threads(host: Host, teachers: int, trainers: int, rollouts: int = 0) -> dict[str, str]:
    """Intra-op threads per teacher / trainer / rollout process, on a CPU or a GPU: the cores
    shared among them.

    Threads of several processes fighting over the same cores make each one slower, not faster.
    On a GPU it shows on the host's critical path: a trainer pads each step's batch and checks
    its targets on the host while the GPU waits, and an OpenMP region of as many threads as the
    machine has cores, beside other processes doing the same, waits for its slowest thread (a
    1 MB fill took 31 ms on a 64-core host running four trainers). Collator workers take one
    thread each of their own.
    """
    procs = teachers + trainers + rollouts
    if not procs or host.threads_set:
        return {}
    return {"OMP_NUM_THREADS": str(max(1, host.cores // procs))}


def _resources(device: str, extra: dict[str, float] | None) -> dict[str, float]:
    """A process's resources: a GPU on CUDA, and the custom ones its role asks for."""
    return {**({"gpu": 1} if device.startswith("cuda") else {}), **(extra or {})}


def _layout(config: RunConfig, gpus: int | None) -> Layout:
    """The run's :class:`Layout`, the GPUs counted only when a process runs on one."""
    if gpus is None:
        cuda = any(device.startswith("cuda") for _, device in config.devices())
        gpus = _gpu_count() if cuda else 0
    return plan_layout(config, gpus)


def _gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:  # pragma: no cover
        return 0
