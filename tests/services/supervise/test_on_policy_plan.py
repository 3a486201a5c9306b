"""A run with on-policy samples: data.on_policy_fraction reaches the trainer, each rollout worker
gets a section of the run's shared values and a process spec, every sample on-policy starts no
collator, and a config the on-policy path cannot run is refused naming the key and the fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.common import config as cfgmod
from services.common.config import ConfigError
from services.rollout.config import RolloutConfig
from services.supervise.config import run_config_from_dict
from services.supervise.plan import Host, RunPlace, make_plan
from services.supervise.preflight import Inputs
from services.trainer.config import TrainerConfig


def config(tmp_path: Path, **overrides):
    data = {
        "run_dir": str(tmp_path / "run"),
        "student_tokenizer": "mistral",
        "teacher_tokenizer": "smollm2",
        "ctx_student": 96,
        "ctx_teacher": 128,
        "trainers": 2,
        "rollouts": 2,
        "data": {"train": "/corpus/train.jsonl", "heldout": "/corpus/h.jsonl", "limit": 40},
        "teacher": {"model": "tiny"},
        "trainer": {
            "student": {"model": "tiny", "seed": 5},
            "feed": {"micro_batch": 4, "grad_accum": 2},
            "loss": {"mode": "pkl", "projection": "/x/proj.pt"},
        },
        "rollout": {"prompt_tokens": 16, "max_new_tokens": 48, "batch": 4},
    }
    for key, value in overrides.items():
        node = data
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return run_config_from_dict(data)


def plan(cfg):
    return make_plan(
        cfg, Inputs.given(cfg), RunPlace.of(cfg), queue="tcp://127.0.0.1:9", master_port=1,
        host=Host(gpus=0, cores=4),
    )  # fmt: skip


def built(p, name: str, cls):
    """Process ``name``'s config as it reads it: its section and the shared context."""
    return cfgmod.from_dict(cls, cfgmod.with_context(cls, p.sections[name], p.shared))


def test_each_rollout_worker_gets_the_runs_values_and_a_process(tmp_path):
    cfg = config(tmp_path, **{"data.on_policy_fraction": 0.25})
    p = plan(cfg)
    trainer = built(p, "trainer", TrainerConfig)
    assert trainer.on_policy.fraction == 0.25
    assert cfg.trainer.on_policy.fraction == 0.0  # computed for the trainer, not written back
    for i in (0, 1):
        assert not {"queue", "partition", "ctx_student"} & set(p.sections[f"rollout{i}"])
        r = built(p, f"rollout{i}", RolloutConfig)
        assert (r.worker, r.workers) == (i, 2)
        assert (r.queue, r.partition) == ("tcp://127.0.0.1:9", "train")
        assert (r.student, r.seed) == ("tiny", 5)  # the trainer's student: its weights come
        assert (r.student_tokenizer, r.teacher_tokenizer) == ("mistral", "smollm2")
        assert (r.ctx_student, r.ctx_teacher) == (96, 128)
        assert r.weights == str(tmp_path / "run" / "policy")
        assert (r.prompts, r.limit) == ("/corpus/train.jsonl", 40)  # the corpus, its limit
        assert r.state_dir == str(tmp_path / "run" / "rollout")
        assert r.run_dir == str(tmp_path / "run")
        # a step of both ranks' on-policy samples (2 x round(0.25 x 8)), at least a batch
        assert r.max_pending == 4
    specs = {s.name: s for s in p.specs}
    assert {"collator", "rollout0", "rollout1"} <= set(specs)
    assert specs["rollout1"].role == "rollout"
    assert specs["rollout1"].group == specs["trainer0"].group  # beside the publishing rank
    config_dir = tmp_path / "run" / "config"
    assert specs["rollout1"].argv == [
        "rollout", "--config", str(config_dir / "rollout1.json"),
        "--context", str(config_dir / "context.json"),
    ]  # fmt: skip
    assert specs["rollout1"].env["XTOKEN_HEARTBEAT_FILE"].endswith("heartbeat/rollout1")
    # four CPU processes (a teacher, two trainers, two rollouts) share four cores
    assert specs["rollout0"].env["OMP_NUM_THREADS"] == "1"
    assert cfg.process_count == len(p.specs)


def test_own_prompts_keep_their_corpus_and_fraction_one_starts_no_collator(tmp_path):
    cfg = config(
        tmp_path,
        **{
            "data.on_policy_fraction": 1.0,
            "trainer.schedule.max_steps": 10,
            "rollout.prompts": "/prompts.jsonl",
            "rollout.prompt_field": "prompt",
        },
    )
    p = plan(cfg)
    r = built(p, "rollout0", RolloutConfig)
    assert (r.prompts, r.limit, r.prompt_field) == ("/prompts.jsonl", None, "prompt")
    names = {s.name for s in p.specs}
    assert "collator" not in names and {"rollout0", "rollout1"} <= names
    assert cfg.process_count == len(p.specs)


def test_without_on_policy_samples_nothing_of_it_is_planned(tmp_path):
    p = plan(config(tmp_path))
    assert not [n for n in p.sections if n.startswith("rollout")]
    assert not [s for s in p.specs if s.role == "rollout"]


@pytest.mark.parametrize(
    ("overrides", "pattern"),
    [
        ({"data.on_policy_fraction": 1.5}, r"on_policy_fraction=1\.5: must be in \[0, 1\]"),
        (
            {"data.on_policy_fraction": 0.5, "trainer.loss.mode": "ce"},
            r"data\.on_policy_fraction=0\.5 with trainer\.loss\.mode=ce: .*use a KD mode",
        ),
        (
            {"data.on_policy_fraction": 0.5, "data.ordered": True, "trainers": 1,
             "rollouts": 1},
            r"data\.on_policy_fraction=0\.5 with data\.ordered: .*set data\.ordered false",
        ),  # fmt: skip
        (
            {"data.on_policy_fraction": 1.0, "trainer.schedule.max_steps": 0},
            r"with trainer\.schedule\.max_steps=0: .*never run out; set "
            r"trainer\.schedule\.max_steps",
        ),
        (
            {"data.on_policy_fraction": 0.5, "rollout.max_new_tokens": 90},
            r"rollout\.prompt_tokens=16 \+ rollout\.max_new_tokens=90 > ctx_student=96",
        ),
        (
            {"data.on_policy_fraction": 0.5, "trainer.on_policy.fraction": 0.3},
            r"trainer\.on_policy\.fraction=0\.3 but data\.on_policy_fraction=0\.5; set "
            r"data\.on_policy_fraction only",
        ),
        (
            {"data.on_policy_fraction": 0.5, "trainer.compute.device": "cuda"},
            r"rollout\.device='cpu' cannot map the trainer's weights on its GPU \(cuda_ipc\)",
        ),
        (
            {"data.on_policy_fraction": 0.5, "trainer.on_policy.sync_every": 0},
            r"trainer\.on_policy: sync_every=0: must be >= 1",
        ),
        ({"rollout.top_p": 0.0}, r"rollout: top_p=0\.0: must be in \(0, 1\]"),
        (
            {"trainer.on_policy.start_step": 5},
            r"^trainer\.on_policy\.start_step=5 with data\.on_policy_fraction=0: .*set the "
            r"fraction above 0",
        ),
        (
            {"data.on_policy_fraction": 1.0, "trainer.on_policy.start_step": 5,
             "trainer.schedule.max_steps": 20},
            r"^trainer\.on_policy\.start_step=5 with data\.on_policy_fraction=1: .*use a "
            r"fraction below 1",
        ),  # fmt: skip
        (
            {"data.on_policy_fraction": 0.5, "trainer.on_policy.start_step": 20,
             "trainer.schedule.max_steps": 20},
            r"^trainer\.on_policy\.start_step=20 with trainer\.schedule\.max_steps=20: the "
            r"on-policy share would never start",
        ),  # fmt: skip
        (
            {"data.on_policy_fraction": 0.5, "trainer.on_policy.start_step": -1},
            r"trainer\.on_policy: start_step=-1: must be >= 0",
        ),
        (
            {"data.on_policy_fraction": 0.5, "trainer.compute.parallel": "fsdp"},
            r"with trainer\.compute\.parallel=fsdp: the rollout workers need the whole student",
        ),
    ],
    ids=[
        "fraction-range", "no-teacher", "ordered", "never-ends", "context", "two-fractions",
        "gpu-weights-cpu-rollout", "sync-every", "top-p", "start-without-fraction",
        "start-with-fraction-one", "start-past-the-end", "negative-start", "fsdp",
    ],
)  # fmt: skip
def test_a_config_the_on_policy_path_cannot_run_names_the_key_and_the_fix(
    tmp_path, overrides, pattern
):
    with pytest.raises(ConfigError, match=pattern):
        config(tmp_path, **overrides)


def test_kd_where_agrees_reaches_the_collator_and_every_rollout_worker(tmp_path):
    """The collators and the rollouts narrow their samples' KD chunks alike: off- and on-policy
    samples of one run keep KD at the same kind of positions."""
    from services.collator.config import CollatorConfig

    cfg = config(tmp_path, **{"data.on_policy_fraction": 0.5, "kd_where_agrees": "qwen3"})
    p = plan(cfg)
    assert p.shared["kd_where_agrees"] == "qwen3"
    assert built(p, "collator", CollatorConfig).worker.kd_where_agrees == "qwen3"
    for i in (0, 1):
        assert built(p, f"rollout{i}", RolloutConfig).kd_where_agrees == "qwen3"
    plain = plan(config(tmp_path, **{"data.on_policy_fraction": 0.5}))
    assert built(plain, "collator", CollatorConfig).worker.kd_where_agrees is None


@pytest.mark.parametrize(
    ("key", "pattern"),
    [
        ("rollout.kd_where_agrees", r"^rollout\.kd_where_agrees is set by the run from "
         r"kd_where_agrees; set kd_where_agrees only$"),
        ("collator.kd_where_agrees", r"^collator\.kd_where_agrees moved to kd_where_agrees$"),
        ("rollout.queue", r"^rollout\.queue is set by the run: its queue's address"),
        ("rollout.weights", r"^rollout\.weights is set by the run \(RUN_DIR/policy\)"),
        ("rollout.student", r"^rollout\.student='x' but trainer\.student\.model='tiny'; set "
         r"trainer\.student\.model only"),
    ],
)  # fmt: skip
def test_a_rollout_key_the_run_sets_is_refused_never_replaced(tmp_path, key, pattern):
    with pytest.raises(ValueError, match=pattern):
        config(tmp_path, **{"data.on_policy_fraction": 0.5, key: "x"})
