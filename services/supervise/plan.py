"""The plan of a run: from its config and settled inputs to each process's own section and the
process specs a launcher starts. Pure: nothing here writes a file or starts a process.

Each process gets only its own section (``run_dir/config/<process>.json``); values that must agree
across processes (queue address, partition, tokenizers, context lengths, run directory) come
from the top of the run config and are written into every section here.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from pathlib import Path
from typing import Any

from services.common import config as cfgmod
from services.common.heartbeat import HEARTBEAT_ENV, HEARTBEAT_S_ENV
from services.launch.spec import ProcessSpec
from services.supervise.config import RunConfig
from services.supervise.preflight import Inputs, slug
from services.trainer.config import TrainerConfig


def default_run_id(run_dir: Path) -> str:
    """The id of a run started without one (``xtoken run``): its directory's name and a hash of
    its absolute path (two runs named alike in different places differ)."""
    digest = hashlib.sha1(str(run_dir).encode()).hexdigest()[:8]
    return f"{slug(run_dir.name)}-{digest}"


@dataclasses.dataclass(frozen=True)
class RunContext:
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
    def of(cls, config: RunConfig, run_id: str | None = None) -> RunContext:
        """The context of ``config`` (``run_id`` None: :func:`default_run_id`)."""
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
        context: the run's :class:`RunContext`.
        queue: the queue address every process connects to.
        master_port: the trainer ranks' rendezvous port.
        sections: file stem (``trainer``, ``teacher0``) -> that section as a JSON mapping.
        run_section: the whole run config with its settled inputs (``config/run.json``).
        specs: the processes, in start order (the queue first when the run has its own).
    """

    context: RunContext
    queue: str
    master_port: int
    sections: dict[str, dict[str, Any]]
    run_section: dict[str, Any]
    specs: tuple[ProcessSpec, ...]


def make_plan(
    config: RunConfig,
    inputs: Inputs,
    context: RunContext,
    *,
    queue: str,
    master_port: int,
    host: Host | None = None,
) -> Plan:
    """Plan one launch of a run.

    Args:
        config: the run config.
        inputs: its settled inputs (:func:`services.supervise.preflight.preflight`, or
            :meth:`Inputs.given` for a config that names them all).
        context: the run's :class:`RunContext`.
        queue: the queue address.
        master_port: the trainer ranks' rendezvous port.
        host: the machine (default: :meth:`Host.here`).

    Raises:
        ValueError: a section that does not build (a loss that needs a projection and has none).
    """
    host = host or Host.here()
    sections = make_sections(config, inputs, context, queue=queue, gpus=host.gpus)
    run_section = cfgmod.to_dict(config)
    run_section["data"].update(train=inputs.train, heldout=inputs.heldout)
    run_section["trainer"]["loss"]["projection"] = inputs.projection
    specs = make_specs(config, inputs, context, queue=queue, master_port=master_port, host=host)
    return Plan(context, queue, master_port, sections, run_section, tuple(specs))


def make_sections(
    config: RunConfig,
    inputs: Inputs,
    context: RunContext,
    *,
    queue: str,
    gpus: int | None = None,
) -> dict[str, dict[str, Any]]:
    """The section of the trainer ranks (``trainer``) and of each teacher group (``teacher<g>``).

    Raises:
        ValueError: a trainer section that does not build (names the key).
    """
    cfg = config
    teacher = dataclasses.replace(
        cfg.teacher, queue=queue, partition=context.partition, tokenizer=cfg.teacher_tokenizer
    )
    trainer_fields = {
        f.name: getattr(cfg.trainer, f.name) for f in dataclasses.fields(TrainerConfig)
    }
    trainer = TrainerConfig(
        **{
            **trainer_fields,
            "loss": dataclasses.replace(cfg.trainer.loss, projection=inputs.projection),
            "queue": queue,
            "partition": context.partition,
            "student_tokenizer": cfg.student_tokenizer,
            "teacher_tokenizer": cfg.teacher_tokenizer,
            "teacher_vocab_size": cfg.trainer.teacher_vocab_size or cfg.teacher.vocab_size,
            "teacher_seed": cfg.teacher.seed,
            "run_dir": str(context.run_dir),
            "heldout": cfg.trainer.heldout or inputs.heldout,
            "teacher_groups": cfg.teachers,
            "max_length": cfg.trainer.max_length or cfg.ctx_student,
        }
    )
    out = {"trainer": cfgmod.to_dict(trainer)}
    for g in range(cfg.teachers):
        device = teacher.device
        if device == "cuda":
            gpus = _gpu_count() if gpus is None else gpus
            device = f"cuda:{g % max(1, gpus)}"
        out[f"teacher{g}"] = cfgmod.to_dict(
            dataclasses.replace(
                teacher,
                group=g,
                device=device,
                heldout=(teacher.heldout or inputs.heldout) if g == 0 else None,
                eval_ctx=cfg.trainer.eval_ctx,
                eval_texts=cfg.trainer.eval_texts,
            )
        )
    return out


def make_specs(
    config: RunConfig,
    inputs: Inputs,
    context: RunContext,
    *,
    queue: str,
    master_port: int,
    host: Host | None = None,
) -> list[ProcessSpec]:
    """The processes of one launch: the queue (unless external), the collator, a teacher per
    group (when the loss uses one) and a trainer per rank, each with its heartbeat file."""
    cfg = config
    host = host or Host.here()
    d = context.run_dir
    specs = []
    if not context.external_queue:
        specs.append(
            ProcessSpec(
                "queue",
                "queue",
                ["queue", "serve", "--bind", queue, "--capacity", cfg.queue_capacity],
                log_file=str(d / "logs" / "queue.log"),
                ready_file=str(d / "ready" / "queue"),
            )
        )
    # the held-out texts may be the last ones of data.train: the collator stops before them
    limit = cfg.data.limit if inputs.train_limit is None else inputs.train_limit
    specs += [
        ProcessSpec(
            "collator",
            "collator",
            [
                "collator",
                "--queue",
                queue,
                "--data",
                str(inputs.train),
                "--student",
                cfg.student_tokenizer,
                "--teacher",
                cfg.teacher_tokenizer,
                "--partition",
                context.partition,
                "--workers",
                str(cfg.collator.workers),
                "--batch",
                str(cfg.collator.batch),
                "--ctx-student",
                str(cfg.ctx_student),
                "--ctx-teacher",
                str(cfg.ctx_teacher),
                "--text-field",
                cfg.data.text_field,
            ]
            + (["--limit", str(limit)] if limit else [])
            + (["--shuffle-seed", str(cfg.data.seed)] if cfg.data.seed is not None else [])
            + (["--skip-bad-lines"] if cfg.data.skip_bad_lines else [])
            + (["--pack"] if cfg.collator.pack else []),
            log_file=str(d / "logs" / "collator.log"),
        ),
    ]
    teachers = cfg.teachers if cfg.trainer.loss.uses_teacher else 0
    threads = cpu_threads(
        host,
        teachers if cfg.teacher.device == "cpu" else 0,
        cfg.trainers if cfg.trainer.device == "cpu" else 0,
    )
    for g in range(teachers):
        specs.append(
            ProcessSpec(
                f"teacher{g}",
                "teacher",
                [
                    "teacher",
                    "--config",
                    str(d / "config" / f"teacher{g}.json"),
                    "--run-dir",
                    str(d),
                ],
                env=dict(threads) if cfg.teacher.device == "cpu" else {},
                log_file=str(d / "logs" / f"teacher{g}.log"),
                ready_file=str(d / "ready" / f"teacher{g}"),
                resources={"gpu": 1} if cfg.teacher.device.startswith("cuda") else {},
                group=str(g),
            )
        )
    for r in range(cfg.trainers):
        env = {
            "RANK": str(r),
            "WORLD_SIZE": str(cfg.trainers),
            "LOCAL_RANK": str(r),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(master_port),
            **(threads if cfg.trainer.device == "cpu" else {}),
        }
        specs.append(
            ProcessSpec(
                f"trainer{r}",
                "trainer",
                ["trainer", "--config", str(d / "config" / "trainer.json")],
                env=env,
                log_file=str(d / "logs" / f"trainer{r}.log"),
                ready_file=str(d / "ready" / f"trainer{r}"),
                resources={"gpu": 1} if cfg.trainer.device.startswith("cuda") else {},
                group=str(r % cfg.teachers),
            )
        )
    for spec in specs:
        spec.env[HEARTBEAT_ENV] = str(d / "heartbeat" / spec.name)
        spec.env[HEARTBEAT_S_ENV] = str(cfg.heartbeat_s)
    return specs


def cpu_threads(host: Host, cpu_teachers: int, cpu_trainers: int) -> dict[str, str]:
    """Intra-op threads per CPU teacher / trainer process: the cores shared among them (threads
    of several processes fighting over the same cores make each one slower, not faster)."""
    procs = cpu_teachers + cpu_trainers
    if not procs or host.threads_set:
        return {}
    return {"OMP_NUM_THREADS": str(max(1, host.cores // procs))}


def _gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:  # pragma: no cover
        return 0
