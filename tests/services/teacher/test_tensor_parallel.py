"""A tensor-parallel teacher group on CPU (gloo): its results equal one teacher's within bf16
rounding (ring slices each rank wrote, hidden states), started by torchrun against a real queue
and spawned in-process; bad settings refused in one line; presets built shard by shard."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from services import protocol as proto
from services.common.lifecycle import read_ready
from services.queue.client import QueueClient
from services.teacher.config import TeacherConfig, check_tensor_parallel
from tests.services.queue.conftest import ServerProcess
from tests.services.teacher.tp_ranks import (
    build_preset_shards,
    free_port,
    serve_whole_then_sharded,
    spawn_group,
)
from xtoken_core.ipc.logit_ring import LogitRingReader
from xtoken_core.models.presets import PRESETS
from xtoken_core.wire import JaggedColumn

ROOT = Path(__file__).resolve().parents[3]
PARTITION = "train"
BF16 = 2**-8  # bf16's relative rounding step (8 bits of mantissa)


def _close(got: torch.Tensor, want: torch.Tensor, steps: float = 2.0) -> None:
    """Equal within ``steps`` bf16 rounding steps of the largest value."""
    assert got.shape == want.shape
    scale = float(want.abs().max())
    err = float((got.float() - want.float()).abs().max())
    assert err <= steps * BF16 * scale, (err, scale)


# ----------------------------------------------------------------------------- bad settings


def test_a_size_that_does_not_divide_the_heads_is_refused_naming_the_sizes_that_would():
    tiny = PRESETS["tiny"].config(1000)  # 4 heads, 2 KV heads, intermediate 128
    check_tensor_parallel(2, tiny)
    with pytest.raises(ValueError) as info:
        check_tensor_parallel(4, tiny, "'tiny'")
    assert str(info.value) == (
        "teacher.tensor_parallel=4 does not divide 'tiny''s 4 attention heads, 2 KV heads and "
        "intermediate size 128; use one of 1, 2"
    )
    seven = PRESETS["qwen2.5-7b"].config(152_064)  # 28 heads, 4 KV heads
    with pytest.raises(
        ValueError, match=r"tensor_parallel=8 does not divide .* use one of 1, 2, 4$"
    ):
        check_tensor_parallel(8, seven)
    check_tensor_parallel(8, PRESETS["qwen2.5-32b"].config(152_064))
    check_tensor_parallel(2, {"num_attention_heads": 6, "intermediate_size": 10})  # KV = heads


@pytest.mark.parametrize("bad", [0, -2, 1.5, "2"])
def test_a_tensor_parallel_below_one_or_not_an_int_is_refused(bad):
    with pytest.raises(ValueError, match=rf"^tensor_parallel={bad!r}: must be an int >= 1"):
        TeacherConfig(tensor_parallel=bad)


def test_the_group_checks_the_heads_before_the_rendezvous(monkeypatch):
    from services.teacher.tensor_parallel import TeacherGroup, model_config

    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    config = TeacherConfig(model="tiny", tensor_parallel=4)
    shapes, folder = model_config("tiny")
    assert folder is None
    with pytest.raises(ValueError, match="^teacher.tensor_parallel=4 does not divide 'tiny'"):
        TeacherGroup.start(config, shapes)  # MASTER_ADDR unset: a rendezvous would fail otherwise


def _cli_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1", **extra)
    return env


def test_a_teacher_asked_for_two_ranks_outside_torchrun_exits_2_in_one_line():
    proc = subprocess.run(
        [sys.executable, "-m", "services.cli", "teacher", "--tensor-parallel", "2",
         "--model", "tiny", "--tokenizer", "smollm2", "--queue", f"tcp://127.0.0.1:{free_port()}"],
        capture_output=True, text=True, timeout=120, cwd=ROOT, env=_cli_env(),
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    errors = [line.split(" ERROR ", 1)[-1] for line in proc.stderr.splitlines() if "error:" in line]
    assert errors == [
        "[teacher] error: teacher.tensor_parallel=2 but this teacher group has WORLD_SIZE=1 "
        "processes; start it with torchrun --nproc-per-node 2, or set teacher.tensor_parallel: 1"
    ]


def test_topk_is_served_by_a_group_and_a_preset_with_hidden_is_refused():
    TeacherConfig(tensor_parallel=2, transport="topk")  # its rows are gathered whole
    TeacherConfig(tensor_parallel=2, transport="hidden")  # a checkpoint folder may use it
    from services.teacher.tensor_parallel import TensorParallelTeacher

    group = type("Group", (), {"size": 2, "rank": 0, "device": torch.device("cpu")})()
    with pytest.raises(ValueError, match="^teacher.transport=hidden with teacher.tensor_parallel"):
        TensorParallelTeacher(
            TeacherConfig(model="tiny", tensor_parallel=2, transport="hidden"), group
        )


# ----------------------------------------------------------------------------- spawned groups


# each transport ~5 s of two spawned ranks: shm in the default suite, the others `pytest -m slow`
@pytest.mark.parametrize(
    "transport",
    [
        "shm",
        pytest.param("hidden", marks=pytest.mark.slow),
        pytest.param("topk", marks=pytest.mark.slow),
    ],
)
def test_a_whole_model_sharded_over_two_ranks_serves_one_teachers_results(tmp_path, transport):
    out = tmp_path / "saved.pt"
    spawn_group(serve_whole_then_sharded, 2, transport, str(out))
    saved = torch.load(out)
    prefix = {"hidden": "one_hidden", "topk": "one_topk"}.get(transport, "one")
    for key in ("a:0", "b:0"):
        want = saved[f"{prefix}:{key}"]
        _close(saved[key], want)  # each rank wrote its vocab columns of the slot (shm)
    torch.testing.assert_close(saved["gathered"], saved["one:a:0"], rtol=1e-5, atol=1e-5)
    assert saved["bpb"] == pytest.approx(saved["one_bpb"], rel=1e-5)  # the held-out eval


SMALL_QWEN2 = dict(
    vocab_size=1001, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
)  # fmt: skip


@pytest.mark.parametrize("tied", [False, True])
def test_a_preset_builds_each_ranks_shards_from_its_seed_on_its_device(tmp_path, tied):
    shape = {**SMALL_QWEN2, "tie_word_embeddings": tied}
    spawn_group(build_preset_shards, 2, shape, 7, str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for r, saved in enumerate(ranks):
        a, b, c = saved["a"], saved["b"], saved["c"]
        assert all(torch.equal(a[n], b[n]) for n in a)  # one seed, one group, run to run
        assert not torch.equal(
            a["model.layers.0.mlp.up_proj.weight"], c["model.layers.0.mlp.up_proj.weight"]
        )
        assert torch.equal(saved["logits_a"], saved["logits_b"])
        shapes = {n: tuple(t.shape) for n, t in a.items()}
        assert shapes["model.layers.0.self_attn.q_proj.weight"] == (32, 64)  # 2 of 4 heads
        assert shapes["model.layers.0.self_attn.k_proj.bias"] == (16,)  # 1 of 2 KV heads
        assert shapes["model.layers.0.self_attn.o_proj.weight"] == (64, 32)
        assert shapes["model.layers.0.mlp.down_proj.weight"] == (64, 48)
        assert shapes["model.embed_tokens.weight"] == (1001, 64)  # replicated
        assert shapes["lm_head.weight"] == ((501, 64) if r == 0 else (500, 64))  # uneven vocab
        assert saved["logits_a"].shape == (2, 6, 501 if r == 0 else 500)
        assert torch.isfinite(saved["logits_a"]).all()
        assert torch.equal(a["model.norm.weight"], torch.ones(64))
        assert not a["model.layers.0.self_attn.q_proj.bias"].any()
        if tied:  # the output layer's rows are the embedding's
            lo = 0 if r == 0 else 501
            assert torch.equal(a["lm_head.weight"], a["model.embed_tokens.weight"][lo : lo + 501])
    # replicated tensors agree across ranks; sharded ones are drawn per rank
    assert torch.equal(
        ranks[0]["a"]["model.embed_tokens.weight"], ranks[1]["a"]["model.embed_tokens.weight"]
    )
    up = "model.layers.0.mlp.up_proj.weight"
    assert not torch.equal(ranks[0]["a"][up], ranks[1]["a"][up])
    assert ranks[0]["plan"][-1] == "model.layers.1.self_attn.v_proj"


def test_a_big_preset_splits_into_local_shards_without_allocating_it(tmp_path):
    from tests.services.teacher.tp_ranks import meta_shards

    spawn_group(meta_shards, 2, "qwen2.5-7b", 152_064, str(tmp_path))
    for r in range(2):
        saved = torch.load(tmp_path / f"meta{r}.pt")
        assert saved["all_meta"]  # nothing was allocated
        shapes = saved["shapes"]
        assert shapes["model.layers.0.self_attn.q_proj.weight"] == (1792, 3584)  # 14 of 28 heads
        assert shapes["model.layers.0.self_attn.k_proj.weight"] == (256, 3584)  # 2 of 4 KV heads
        assert shapes["model.layers.27.mlp.gate_proj.weight"] == (9472, 3584)
        assert shapes["model.layers.27.mlp.down_proj.weight"] == (3584, 9472)
        assert shapes["lm_head.weight"] == (76_032, 3584)
        assert shapes["model.embed_tokens.weight"] == (152_064, 3584)
        # half of every layer and of the output layer, the embedding and norms whole
        whole, embedding = saved["whole"], 152_064 * 3584
        assert (
            saved["local"] == (whole - embedding - saved["norms"]) // 2 + embedding + saved["norms"]
        )


# ----------------------------------------------------------------------------- torchrun + queue


@pytest.fixture
def queue(tmp_path):
    server = ServerProcess(tmp_path, "--capacity", "64MiB")
    yield server.address
    server.stop()


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    """The tiny preset (seed 3) exported as a checkpoint folder."""
    from xtoken_core.models import export_hf, load_model

    folder = tmp_path_factory.mktemp("tiny") / "model"
    export_hf(load_model("tiny", vocab_size=49152, seed=3), folder, tokenizer="smollm2")
    return folder


def _claim(client, rank: int, fields: list[str], want: int, timeout_s: float = 60.0) -> dict:
    """Claim the result fields of ``rank`` until ``want`` requests have theirs."""
    out: dict[str, dict] = {}
    deadline = time.monotonic() + timeout_s
    part = proto.request_partition(PARTITION, 0)
    while len(out) < want and time.monotonic() < deadline:
        got = client.claim(part, f"test-trainer{rank}", fields, 8, timeout_s=0.5)
        for i, key in enumerate(got["keys"]):
            out[key] = {}
            for name in fields:
                row = got["fields"][name].row(i)
                out[key][name] = JaggedColumn(row, torch.tensor([0, row.shape[0]]))
    return out


@pytest.mark.parametrize("transport", ["shm", pytest.param("hidden", marks=pytest.mark.slow)])
def test_a_group_started_by_torchrun_serves_a_queue_with_one_teachers_results(
    tmp_path, queue, tiny_folder, transport
):
    from services.teacher.worker import TeacherWorker

    ready, exit_file = tmp_path / "ready", tmp_path / "exit.json"
    log = open(tmp_path / "group.log", "w")
    group = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
         "-m", "services.cli", "teacher", "--queue", queue, "--partition", PARTITION,
         "--model", str(tiny_folder), "--tokenizer", "smollm2", "--tensor-parallel", "2",
         "--transport", transport, "--max-batch", "2", "--max-length", "16",
         "--claim-timeout-s", "0.2", "--ready-file", str(ready)],
        cwd=ROOT, env=_cli_env(XTOKEN_EXIT_FILE=str(exit_file)), stdout=log,
        stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while read_ready(ready) is None:
            assert group.poll() is None, (tmp_path / "group.log").read_text()
            assert time.monotonic() < deadline, (tmp_path / "group.log").read_text()
            time.sleep(0.2)
        assert read_ready(ready)["pid"] != group.pid  # rank 0's own record
        one = TeacherWorker(TeacherConfig(model=str(tiny_folder), tokenizer="smollm2",
                                          max_batch=2, max_length=16))  # fmt: skip
        g = torch.Generator().manual_seed(11)
        rows = {
            ("a:0", 0): [torch.randint(0, 49152, (n,), generator=g) for n in (16, 9)],
            ("b:0", 1): [torch.randint(0, 49152, (5,), generator=g)],
        }
        part = proto.request_partition(PARTITION, 0)
        with QueueClient(queue, timeout_s=10) as client, LogitRingReader() as reader:
            for (key, rank), r in rows.items():
                client.put(part, [key], proto.request_fields(r, rank))
            for (key, rank), r in rows.items():
                fields = [proto.result_field(rank)]
                if transport == "hidden":
                    fields.append(proto.hidden_field(rank))
                got = _claim(client, rank, fields, 1)[key]
                result = proto.Result.from_blob(got[proto.result_field(rank)], key)
                assert result.error is None, result.error
                request = proto.decode_request(key, proto.request_fields(r, rank), 0, one.pad_id)
                B, U = request.ids_BU.shape
                if transport == "hidden":
                    hidden = proto.hidden_from_column(got[proto.hidden_field(rank)], B, U, key)
                    _close(hidden, one.hidden_states(request))
                else:
                    view = reader.view(result.descriptor, result.handle)
                    _close(view, one.logits(request))  # both ranks' columns of the slot
                    reader.release(result.descriptor, result.handle)
        one.close()
    finally:
        os.killpg(group.pid, signal.SIGTERM)
        try:
            group.wait(timeout=60)
        finally:
            if group.poll() is None:
                os.killpg(group.pid, signal.SIGKILL)
            log.close()
    assert json.loads(exit_file.read_text())["code"] == 0, (tmp_path / "group.log").read_text()


def test_a_preset_built_without_a_group_is_whole_tied_and_repeats_its_seed():
    from services.teacher.shards import build_sharded_model

    def build(seed: int) -> torch.nn.Module:
        return build_sharded_model(
            "tiny", None, vocab_size=1000, dtype=torch.float32, device=torch.device("cpu"),
            seed=seed,
        )  # fmt: skip

    a, b, c = build(1), build(1), build(2)
    ids = torch.arange(10)[None]
    with torch.inference_mode():
        logits_a, logits_b, logits_c = (m(ids).logits for m in (a, b, c))
    assert logits_a.shape == (1, 10, 1000) and torch.isfinite(logits_a).all()
    assert torch.equal(logits_a, logits_b) and not torch.equal(logits_a, logits_c)
    assert torch.equal(a.lm_head.weight, a.model.embed_tokens.weight)  # the preset is tied
