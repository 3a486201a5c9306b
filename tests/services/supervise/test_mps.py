"""The run's own MPS daemon (``mps: true``): who becomes its client, and what is refused."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from services.common import config as cfgmod
from services.supervise.config import run_config_from_dict, run_config_to_dict
from services.supervise.driver import Driver
from services.supervise.mps import (
    CONTROL,
    LOG_ENV,
    PIPE_ENV,
    VISIBLE_ENV,
    MpsDaemon,
    client_visible_devices,
    control_binary,
)
from services.supervise.plan import Host, RunPlace, make_plan
from services.supervise.preflight import Inputs, preflight
from tests.extras import require_tokenizers


def _config(tmp_path, device="cuda", **run):
    return run_config_from_dict(
        {
            "run_dir": str(tmp_path / "run"),
            "mps": True,
            "trainer": {"student": {"model": "tiny"}, "compute": {"device": device}},
            "teacher": {"model": "tiny", "device": device},
            **run,
        }
    )


def test_the_gpu_processes_are_clients_of_the_runs_daemon_and_the_others_are_not(tmp_path):
    config = _config(tmp_path)
    context = RunPlace.of(config, "r1")
    inputs = Inputs("/data/train.jsonl", "/data/heldout.txt", "/cache/proj.pt")
    plan = make_plan(config, inputs, context, queue="tcp://127.0.0.1:7", master_port=9, host=Host())
    env = {spec.name: spec.env for spec in plan.specs}
    folder = context.run_dir / "mps"
    for name in ("teacher0", "trainer0"):
        assert env[name][PIPE_ENV] == str(folder / "pipe")
        assert env[name][LOG_ENV] == str(folder / "log")
    for name in ("queue", "collator"):
        assert PIPE_ENV not in env[name]
    plain = run_config_from_dict({**run_config_to_dict(config), "mps": False})
    plan = make_plan(plain, inputs, context, queue="tcp://127.0.0.1:7", master_port=9, host=Host())
    assert all(PIPE_ENV not in spec.env for spec in plan.specs)


def test_clients_number_the_gpus_of_a_daemon_started_on_some_of_them_from_zero(
    tmp_path, monkeypatch
):
    """A daemon started with CUDA_VISIBLE_DEVICES=2,3 serves those GPUs as 0 and 1: a client
    that kept 2,3 found no GPU (two ranks on GPUs 2 and 3 of a four-GPU host)."""
    monkeypatch.setenv(VISIBLE_ENV, "2,3")
    config = _config(tmp_path)
    context = RunPlace.of(config, "r1")
    inputs = Inputs("/data/train.jsonl", "/data/heldout.txt", "/cache/proj.pt")
    plan = make_plan(config, inputs, context, queue="tcp://127.0.0.1:7", master_port=9, host=Host())
    env = {spec.name: spec.env for spec in plan.specs}
    assert env["trainer0"][VISIBLE_ENV] == env["teacher0"][VISIBLE_ENV] == "0,1"
    assert VISIBLE_ENV not in env["queue"]


@pytest.mark.parametrize(
    "visible, client",
    [
        (None, None),
        ("", None),
        ("3", "0"),
        ("1, 0", "0,1"),
        ("GPU-5f2a,GPU-77c1", None),  # UUIDs name the same GPUs in the server
    ],
)
def test_a_clients_visible_devices_follow_the_daemons(visible, client):
    assert client_visible_devices(visible) == client


def test_mps_without_a_process_on_a_gpu_is_refused_naming_the_setting(tmp_path):
    with pytest.raises(
        cfgmod.ConfigError,
        match=r"mps: true but no process of the run is on a "
        r"CUDA device \(trainer.compute.device=cpu, teacher.device=cpu\): set mps: false",
    ):
        _config(tmp_path, device="cpu")


@pytest.mark.skipif(shutil.which(CONTROL) is not None, reason="the MPS control program is here")
def test_mps_without_the_control_program_is_refused_before_anything_starts(tmp_path):
    with pytest.raises(ValueError, match=rf"{CONTROL} is not on PATH .*set mps: false"):
        control_binary()
    config = _config(tmp_path)
    # past the device check, to the program
    config.trainer.compute.device = config.teacher.device = "cpu"
    with pytest.raises(ValueError, match=rf"{CONTROL} is not on PATH"):
        preflight(config)
    assert not (tmp_path / "run").exists()


@pytest.mark.skipif(shutil.which(CONTROL) is not None, reason="the MPS control program is here")
def test_xtoken_run_with_mps_but_no_control_program_exits_2_with_one_line(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text(
        f"run_dir: {tmp_path / 'run'}\nmps: true\n"
        "trainer: {student: {model: tiny}, compute: {device: cuda}}\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "services.cli", "run", str(config)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("xtoken run:")]
    assert len(errors) == 1, done.stderr
    # a machine without a GPU names the device first; one with a GPU, the control program
    assert "trainer.compute.device='cuda'" in errors[0] or CONTROL in errors[0]


def test_a_run_launched_elsewhere_than_this_machine_cannot_have_mps(tmp_path):
    with pytest.raises(ValueError, match=r"mps: true needs the run's processes on this machine"):
        Driver(_config(tmp_path), launcher=object())


def test_a_daemon_that_never_started_is_stopped_without_a_call(tmp_path):
    daemon = MpsDaemon(tmp_path / "mps")
    assert not daemon.running()
    daemon.stop()  # no daemon, no control program needed
    assert not (tmp_path / "mps").exists()


@pytest.mark.gpu
@pytest.mark.timeout(600)
@pytest.mark.skipif(shutil.which(CONTROL) is None, reason="needs the MPS control program")
def test_a_run_with_mps_trains_as_clients_of_its_daemon_and_stops_it(tmp_path):
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    require_tokenizers("mistral", "smollm2")
    run_dir = tmp_path / "run"
    config = tmp_path / "run.yaml"
    config.write_text(
        "\n".join(
            [
                f"run_dir: {run_dir}",
                "mps: true",
                "student_tokenizer: mistral",
                "teacher_tokenizer: smollm2",
                "ctx_student: 64",
                "ctx_teacher: 64",
                "data: {limit: 64}",
                "collator: {workers: 1, batch: 16}",
                "teacher: {model: tiny, device: cuda, transport: cuda_ipc, max_batch: 4, "
                "max_length: 64}",
                "trainer: {student: {model: tiny}, compute: {device: cuda}, "
                "feed: {micro_batch: 4, grad_accum: 1}, schedule: {max_steps: 4, "
                "checkpoint_every: 0, eval_every: 0, export: false}, eval: {texts: 4, ctx: 64}}",
            ]
        )
        + "\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "services.cli", "run", str(config), "--no-progress"],
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    log = run_dir / "mps" / "log"
    assert (log / "control.log").exists()
    # the server starts when the first client connects: the teacher's and trainer's contexts
    assert (log / "server.log").exists(), sorted(p.name for p in log.iterdir())
    assert not MpsDaemon(run_dir / "mps").running()  # quit with the run
