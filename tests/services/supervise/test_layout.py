"""The run's layout: which GPU each trainer rank and teacher rank takes, the processes a
tensor-parallel teacher group is launched as, and the pre-flight refusals of a layout the
machine cannot run (one line naming the key and what would fit)."""

from __future__ import annotations

import pytest

from services.supervise.config import run_config_from_dict
from services.supervise.layout import (
    GIB,
    GpuMemory,
    Layout,
    check_layout,
    model_config,
    parameter_count,
    plan_layout,
)
from services.supervise.plan import Host, RunPlace, make_context, make_sections, make_specs
from services.supervise.preflight import Inputs
from tests.services.control.conftest import tiny_config
from xtoken_core.errors import SettingsError


def _config(**overrides):
    return run_config_from_dict(tiny_config(**overrides))


def _cuda(**overrides):
    return _config(**{"trainer.compute.device": "cuda", "teacher.device": "cuda", **overrides})


def test_by_default_trainer_rank_r_takes_gpu_r_and_teacher_group_g_its_gpus_from_g_times_k():
    one = plan_layout(_cuda(), 4)
    assert one == Layout(trainer_gpus=(0,), teacher_gpus=((0,),))  # colocated, as before
    tp = plan_layout(_cuda(trainers=2, teachers=2, **{"teacher.tensor_parallel": 2}), 4)
    assert tp == Layout(trainer_gpus=(0, 1), teacher_gpus=((0, 1), (2, 3)))
    assert tp.describe() == (
        "trainer ranks on GPU 0,1; teacher group 0 (tensor parallel 2) on GPU 0,1; "
        "teacher group 1 (tensor parallel 2) on GPU 2,3"
    )
    assert plan_layout(_config(), 4) == Layout()  # on the CPU: no GPU taken


def test_named_gpus_place_dedicated_teacher_groups_and_trainer_ranks():
    config = _cuda(
        trainers=2,
        **{"trainer.gpus": [0, 1], "teacher.gpus": [2, 3], "teacher.tensor_parallel": 2},
    )
    layout = plan_layout(config, 4)
    assert layout == Layout(trainer_gpus=(0, 1), teacher_gpus=((2, 3),))
    check_layout(config, layout, 4)


@pytest.mark.parametrize(
    ("overrides", "gpus", "pattern"),
    [
        ({"teacher.gpus": [5]}, 4, r"^teacher\.gpus names GPU 5, but this machine shows 4 "
         r"\(GPUs 0-3\); name GPUs that are there$"),
        ({"trainer.gpus": [0, 1]}, 4, r"^trainer\.gpus names 2 GPU\(s\) for trainers=1; name one "
         r"GPU per trainer rank$"),
        ({"teacher.gpus": [1, 2, 3], "teacher.tensor_parallel": 2}, 4,
         r"^teacher\.gpus names 3 GPU\(s\) for teachers=1 x teacher\.tensor_parallel=2; name 2$"),
        ({"teacher.gpus": [1, 1], "teacher.tensor_parallel": 2}, 4,
         r"^teacher\.gpus puts two ranks of teacher group 0 on one GPU \(1,1\)"),
        ({"trainers": 2, "trainer.gpus": [1, 1], "teacher.max_batch": 4}, 4,
         r"^trainer\.gpus=\[1, 1\] puts two trainer ranks on one GPU"),
        ({}, 0, r"^trainer\.gpus names GPU 0, but this machine shows 0 \(GPUs none\)"),
    ],
)  # fmt: skip
def test_a_layout_the_machine_cannot_run_is_refused_naming_the_key(overrides, gpus, pattern):
    config = _cuda(**overrides)
    with pytest.raises(SettingsError, match=pattern):
        check_layout(config, plan_layout(config, gpus), gpus)


def test_a_parallel_size_that_does_not_divide_the_teachers_heads_is_refused_with_what_fits():
    config = _config(**{"teacher.tensor_parallel": 3})  # tiny: 4 heads
    shape = model_config("tiny", 1000)
    with pytest.raises(SettingsError, match=r"teacher\.tensor_parallel=3 does not divide tiny"
                       r"'s 4 attention heads, 2 KV heads .*; use one of 1, 2$"):  # fmt: skip
        check_layout(config, plan_layout(config, 0), 0, teacher_model_config=shape)
    ok = _config(**{"teacher.tensor_parallel": 2})
    check_layout(ok, plan_layout(ok, 0), 0, teacher_model_config=shape)


def test_a_teacher_too_big_for_its_gpu_is_refused_naming_the_parallel_size_that_fits():
    config = _cuda(**{"teacher.model": "teacher-1.5b"})
    params = parameter_count(model_config("teacher-1.5b", 151_669))
    assert 1.5e9 < params < 1.6e9  # counted on the meta device, the tied output layer once
    gpu = GpuMemory(total=4 * GIB, free=3 * GIB)
    with pytest.raises(SettingsError) as refused:
        check_layout(config, plan_layout(config, 1), 1, [gpu], teacher_params=params)
    assert str(refused.value) == (
        "GPU 0 would hold at least 3.9 GiB (2.9 GiB of teacher group 0's weights) but has "
        "3.0 GiB free; set teacher.tensor_parallel: 2 (1.4 GiB of teacher weights per GPU), "
        "or put the teacher on GPUs of its own (teacher.gpus)"
    )
    check_layout(config, plan_layout(config, 1), 1, [GpuMemory(80 * GIB, 79 * GIB)],
                 teacher_params=params, student_params=params)  # fmt: skip


def test_gpu_trainers_and_teachers_share_the_hosts_cores_as_cpu_ones_do(tmp_path):
    # 2 trainers and a group of 2 teacher ranks on a 16-core host: 4 intra-op threads each,
    # not 16 each fighting over the same cores while the GPUs wait for the host
    config = _cuda(trainers=2, **{"teacher.tensor_parallel": 2, "teacher.gpus": [2, 3]})
    place = RunPlace.of(run_config_from_dict(tiny_config(run_dir=str(tmp_path / "run"))))
    specs = make_specs(config, place, master_port=1, host=Host(cores=16, gpus=4))
    threads = {s.name: s.env.get("OMP_NUM_THREADS") for s in specs if s.role != "collator"
               and s.role != "queue"}  # fmt: skip
    assert threads == {"teacher0": "4", "teacher0.1": "4", "trainer0": "4", "trainer1": "4"}
    # a user's own setting stands
    mine = make_specs(config, place, master_port=1, host=Host(cores=16, gpus=4, threads_set=True))
    assert all("OMP_NUM_THREADS" not in s.env for s in mine)


def test_a_tensor_parallel_group_is_k_teacher_processes_of_one_unit_in_torchruns_environment(
    tmp_path,
):
    config = _cuda(trainers=2, **{"teacher.tensor_parallel": 2, "teacher.gpus": [2, 3]})
    place = RunPlace.of(run_config_from_dict(tiny_config(run_dir=str(tmp_path / "run"))))
    specs = {s.name: s for s in make_specs(config, place, master_port=1, host=Host(cores=8,
                                                                                  gpus=4))}  # fmt: skip
    group = [specs["teacher0"], specs["teacher0.1"]]
    assert [s.unit for s in group] == ["teacher0", "teacher0"]
    assert [(s.env["RANK"], s.env["WORLD_SIZE"], s.env["LOCAL_RANK"]) for s in group] == [
        ("0", "2", "2"),
        ("1", "2", "3"),
    ]
    assert group[0].argv == group[1].argv  # one section file: teacher0.json
    assert group[0].ready_file and group[1].ready_file is None  # rank 0 speaks for the group
    assert [specs[f"trainer{r}"].env["LOCAL_RANK"] for r in range(2)] == ["0", "1"]
    inputs = Inputs("train.jsonl", "heldout.txt", "projection.pt")
    sections = make_sections(config, inputs, make_context(config, place, queue="tcp://q:1"),
                             gpus=4)  # fmt: skip
    assert sections["teacher0"]["device"] == "cuda"  # each rank: cuda:LOCAL_RANK
    assert sections["teacher0"]["tensor_parallel"] == 2
    one = _cuda(**{"teacher.gpus": [3]})
    assert make_sections(one, inputs, make_context(one, place, queue="tcp://q:1"),
                         gpus=4)["teacher0"]["device"] == "cuda:3"  # fmt: skip


def test_teachers_asking_for_other_resources_than_the_trainers_are_placed_apart_by_them(tmp_path):
    config = _config(
        run_dir=str(tmp_path / "run"),
        trainers=2,
        **{"teacher.resources": {"teacher_node": 1}, "teacher.transport": "topk"},
    )
    assert config.teachers_apart
    specs = {s.name: s for s in make_specs(config, RunPlace.of(config), master_port=1)}
    assert specs["teacher0"].resources == {"teacher_node": 1}
    assert specs["teacher0"].group == "teacher0"  # not pinned beside the ranks it serves
    assert [specs[f"trainer{r}"].group for r in range(2)] == ["0", "0"]
    together = _config(run_dir=str(tmp_path / "run"))
    assert not together.teachers_apart
    specs = {s.name: s for s in make_specs(together, RunPlace.of(together), master_port=1)}
    assert specs["teacher0"].group == specs["trainer0"].group == "0"


def test_transport_auto_is_a_ring_beside_the_trainers_and_topk_apart_from_them():
    from services.supervise.layout import run_transport

    auto = {"teacher.transport": "auto"}
    assert _config(**auto).teacher.transport == "auto"  # the run decides, knowing the placement
    assert run_transport(_config(**auto)) == "shm"
    assert run_transport(_cuda(**auto)) == "cuda_ipc"
    apart = _config(**auto, **{"trainer.resources": {"trainer_node": 1}})
    assert apart.teachers_apart and run_transport(apart) == "topk"
    assert run_transport(_config(**{"teacher.transport": "hidden"})) == "hidden"
    with pytest.raises(ValueError, match=r"^teacher\.transport=shm: a ring cannot reach trainer "
                       r"ranks on other nodes .*; use teacher\.transport auto, topk or hidden$"):
        _config(**{"teacher.resources": {"teacher_node": 1}})


def test_the_big_teacher_example_plans_two_two_gpu_groups_beside_four_trainer_ranks():
    from pathlib import Path

    from services.supervise.config import load_run_config

    example = Path(__file__).resolve().parents[3] / "examples" / "big_teacher.yaml"
    config = load_run_config(example)
    layout = plan_layout(config, 4)
    assert layout == Layout(trainer_gpus=(0, 1, 2, 3), teacher_gpus=((0, 1), (2, 3)))
    check_layout(config, layout, 4, teacher_model_config=model_config("qwen2.5-32b", 129_280))
    with pytest.raises(SettingsError, match=r"trainer\.gpus names GPU 2, but this machine "):
        check_layout(config, plan_layout(config, 2), 2)


def test_topk_targets_under_pkl_over_a_column_subset_get_one_warning_naming_the_setting(caplog):
    from services.supervise.preflight import check_transport

    topk = _config(**{"teacher.transport": "topk", "trainer.loss.mode": "pkl"})
    with caplog.at_level("WARNING"):
        check_transport(topk, 49_152)
    assert [r.message.rsplit("; ", 1)[1] for r in caplog.records] == [
        "set trainer.loss.vocab_topk: null"
    ]
    caplog.clear()
    every = _config(**{"teacher.transport": "topk", "trainer.loss.vocab_topk": None})
    with caplog.at_level("WARNING"):
        check_transport(every, 49_152)
        check_transport(_config(), 49_152)  # a ring: the logits themselves
    assert not caplog.records
