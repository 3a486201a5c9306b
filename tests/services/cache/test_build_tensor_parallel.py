"""`xtoken cache build` of a teacher with `tensor_parallel: 2` on CPU (gloo): the group's cache is
a one-process build's of the same weights (keys, ids, lengths, top K within bf16 rounding, the
fingerprint), the slices' top K merge into the whole vocab's, a group started by torchrun and
SIGKILLed mid-build continues with every sample written once, and a group outside torchrun is
refused in one line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from services.cache.build import BuildOptions, CacheBuilder
from services.cache.check import CACHE_RUN_KEYS, run_fingerprint
from services.cache.fingerprint import preset_draw, weights_hash
from services.cache.group import merge_topk, slice_topk
from services.supervise.config import load_run_config
from services.teacher.shards import column_bounds
from tests.services.cache.tp_build_ranks import build_with_group
from tests.services.teacher.tp_ranks import free_port, spawn_group
from xtoken_core.cache.format import Codec
from xtoken_core.cache.manifest import fingerprint_changes, read_manifest
from xtoken_core.cache.reader import CacheReader
from xtoken_core.wire.topk import encode_topk

ROOT = Path(__file__).resolve().parents[3]
BF16 = 2**-8  # bf16's relative rounding step (8 bits of mantissa)

CONFIG = """\
run_dir: {tmp}/run
student_tokenizer: mistral
teacher_tokenizer: smollm2
ctx_student: 32
ctx_teacher: 32
data: {{train: {tmp}/corpus.jsonl}}
teacher: {{model: {model}, max_batch: 4, max_length: 32, top_k: 8, tensor_parallel: {tp}}}
"""


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    """The tiny preset (seed 3) exported as a checkpoint folder: one process and a group of two
    read the same weights."""
    from xtoken_core.models import export_hf, load_model

    folder = tmp_path_factory.mktemp("tiny") / "model"
    export_hf(load_model("tiny", vocab_size=49152, seed=3), folder, tokenizer="smollm2")
    return folder


def _setup(tmp: Path, model: Path, texts: int) -> int:
    """A corpus of ``texts`` texts and an empty one, and run configs of one process
    (``run1.yaml``) and of a group of two (``run2.yaml``); returns the corpus's size."""
    rows = [f"text number {i}: " + "word " * (i % 7) for i in range(texts)] + [""]
    (tmp / "corpus.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in rows))
    for tp in (1, 2):
        (tmp / f"run{tp}.yaml").write_text(CONFIG.format(tmp=tmp, model=model, tp=tp))
    return len(rows)


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1")
    return env


def _cli(*argv: str, torchrun: bool = False) -> list[str]:
    launcher = [sys.executable]
    if torchrun:
        launcher += ["-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
                     "127.0.0.1", "--master-port", str(free_port())]  # fmt: skip
    return [*launcher, "-m", "services.cli", "cache", *argv]


def _keys(out: Path) -> list[str]:
    import pyarrow.parquet as pq

    return [
        k
        for s in read_manifest(out)["shards"]
        for k in pq.read_table(out / s["path"], columns=["key"])["key"].to_pylist()
    ]


def _same_targets(got, want) -> None:
    """One sample's targets agree: ids and lengths equal, the top K's ids equal but where
    log-probs tie within bf16 rounding at the K-th, the log-probs within bf16 rounding."""
    assert np.array_equal(got.teacher_ids_U, want.teacher_ids_U)
    assert got.ids_UK.shape == want.ids_UK.shape
    for u in range(got.ids_UK.shape[0]):
        a = dict(zip(got.ids_UK[u].tolist(), got.logprobs_UK[u].tolist(), strict=True))
        b = dict(zip(want.ids_UK[u].tolist(), want.logprobs_UK[u].tolist(), strict=True))
        kth = min(b.values())
        for i in a.keys() ^ b.keys():  # in one top K only: a tie at the K-th
            lp = a.get(i, b.get(i))
            assert abs(lp - kth) <= 2 * BF16 * max(1.0, abs(kth)), (u, i, lp, kth)
        for i in a.keys() & b.keys():
            assert abs(a[i] - b[i]) <= 2 * BF16 * max(1.0, abs(b[i])), (u, i, a[i], b[i])
    for name in ("lse_U", "rest_U"):
        x, y = getattr(got, name), getattr(want, name)
        assert np.array_equal(np.isinf(x), np.isinf(y)), name
        finite = np.isfinite(y)
        assert np.allclose(x[finite], y[finite], rtol=2 * BF16, atol=2 * BF16), name


# ----------------------------------------------------------------------------- the merge


@pytest.mark.parametrize("kernel", [False, True], ids=["torch", "triton"])
@pytest.mark.parametrize(("W", "S", "k"), [(1001, 3, 8), (50, 2, 25), (7, 2, 3)])
def test_the_slices_top_k_merge_into_the_whole_vocabs(W, S, k, kernel, monkeypatch):
    g = torch.Generator().manual_seed(W)
    logits_NW = torch.randn(2, 5, W, generator=g).reshape(10, W) * 4
    logits_NW[0, : W // 2] = float("-inf")  # a position whose top K all lie in the last slice
    want = encode_topk(logits_NW, k)  # the whole row, through PyTorch ops
    if kernel:  # the slices through the one-pass kernel a GPU takes, in Triton's interpreter
        pytest.importorskip("triton")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    parts = []
    for r in range(S):
        lo, hi = column_bounds(W, S, r)
        parts.append(slice_topk(logits_NW[:, lo:hi], k, lo))
    values, ids, tails = (torch.stack(t) for t in zip(*parts, strict=True))
    got = merge_topk(values, ids, tails, k)
    assert torch.equal(got.ids_NK, want.ids_NK) and got.ids_NK.dtype == torch.int32
    torch.testing.assert_close(got.logprobs_NK, want.logprobs_NK, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.lse_N, want.lse_N, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(got.rest_N, want.rest_N, rtol=1e-5, atol=1e-5)


def test_a_top_k_that_takes_every_id_leaves_no_rest():
    logits_NW = torch.randn(4, 6)
    parts = [slice_topk(logits_NW[:, lo:hi], 3, lo) for lo, hi in ((0, 3), (3, 6))]
    values, ids, tails = (torch.stack(t) for t in zip(*parts, strict=True))
    got = merge_topk(values, ids, tails, 6)
    assert torch.isneginf(got.rest_N).all()
    torch.testing.assert_close(got.lse_N, torch.logsumexp(logits_NW, -1))


# ----------------------------------------------------------------------------- the fingerprint


def test_a_checkpoints_weights_hash_ignores_the_group_and_a_presets_names_its_draw(tiny_folder):
    assert preset_draw(1, "cpu") is None  # one CPU stream
    assert preset_draw(1, "cuda:1") == "tensor_parallel=1/cuda"  # a generator per tensor
    group = preset_draw(2, "cuda:0")
    assert group == "tensor_parallel=2/cuda"
    folder = str(tiny_folder)
    assert weights_hash(folder, None, 0, group) == weights_hash(folder, None, 0)
    one = weights_hash("tiny", 49152, 3)
    drawn = {weights_hash("tiny", 49152, 3, preset_draw(k, d)) for k in (2, 4) for d in "ab"}
    assert one not in drawn and len(drawn) == 4  # each group's draw is its own weights


# ----------------------------------------------------------------------------- spawned groups


def test_a_groups_cache_is_a_one_process_builds_of_the_same_weights(tmp_path, tiny_folder):
    n = _setup(tmp_path, tiny_folder, 30)
    group, one = tmp_path / "group", tmp_path / "one"
    spawn_group(build_with_group, 2, str(tmp_path / "run2.yaml"), str(group), {"shard_mb": 0.002})
    ranks = [json.loads((tmp_path / f"group.rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["summary"] == {"written": n, "complete": True}
    assert ranks[1]["summary"] is None  # rank 0 alone reports
    options = BuildOptions(out=str(one), codec=Codec(logprobs="fp32"), progress=False)
    summary = CacheBuilder(load_run_config(tmp_path / "run1.yaml"), options).run()
    assert summary.written == n

    got, want = read_manifest(group), read_manifest(one)
    assert got["fingerprint"] == want["fingerprint"]
    assert len(got["shards"]) > 1 and got["builders"] == {"0/1": {"done": True}}
    keys = _keys(group)
    assert len(keys) == len(set(keys)) == n
    a, b = CacheReader(group), CacheReader(one)
    assert sorted(a.keys()) == sorted(b.keys())
    for key in b.keys():
        _same_targets(a.get(key), b.get(key))
    # the cache serves a run whose teacher is one process or a group alike
    for tp in (1, 2):
        config = load_run_config(tmp_path / f"run{tp}.yaml")
        wanted = run_fingerprint(config, config.teacher_list()[0])
        assert not fingerprint_changes(got["fingerprint"], wanted, CACHE_RUN_KEYS)


@pytest.mark.slow
def test_a_group_and_one_process_share_a_corpus_by_key_into_one_cache(tmp_path, tiny_folder):
    n = _setup(tmp_path, tiny_folder, 20)
    out = tmp_path / "cache"
    spawn_group(build_with_group, 2, str(tmp_path / "run2.yaml"), str(out), {"shard": (0, 2)})
    summary = json.loads((tmp_path / "cache.rank0.json").read_text())["summary"]
    assert not summary["complete"]  # builder 1/2 is still to run
    first = set(_keys(out))
    options = BuildOptions(
        out=str(out), shard=(1, 2), codec=Codec(logprobs="fp32"), progress=False
    )  # the same fingerprint: one process may build the other half
    assert CacheBuilder(load_run_config(tmp_path / "run1.yaml"), options).run().complete
    keys = _keys(out)
    assert len(keys) == len(set(keys)) == n and first < set(keys)
    assert read_manifest(out)["builders"] == {"0/2": {"done": True}, "1/2": {"done": True}}


def _descendants(pid: int) -> list[int]:
    """The processes under ``pid`` (torchrun starts each rank in a session of its own)."""
    found, todo = [], [pid]
    while todo:
        for task in Path(f"/proc/{todo.pop()}/task").glob("*"):
            try:
                children = [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
            found += children
            todo += children
    return found


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] in ("Z", "X")
    except OSError:
        return True


@pytest.mark.slow
def test_a_group_started_by_torchrun_and_killed_mid_build_continues_writing_each_sample_once(
    tmp_path, tiny_folder
):
    n = _setup(tmp_path, tiny_folder, 60)
    out = tmp_path / "cache"
    # one text per forward and per shard: the group is killed between two shards
    argv = _cli("build", str(tmp_path / "run2.yaml"), "--out", str(out), "--no-progress",
                "--batch-tokens", "1", "--shard-mb", "0.000001", torchrun=True)  # fmt: skip
    log = open(tmp_path / "group.log", "w")
    group = subprocess.Popen(
        argv, cwd=ROOT, env=_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 240
        while True:
            manifest = read_manifest(out) if (out / "manifest.json").exists() else None
            if manifest is not None and len(manifest["shards"]) >= 2:
                break
            assert group.poll() is None, (tmp_path / "group.log").read_text()
            assert time.monotonic() < deadline, (tmp_path / "group.log").read_text()
            time.sleep(0.02)
        ranks = _descendants(group.pid)
        assert len(ranks) >= 2, ranks
        os.killpg(group.pid, signal.SIGKILL)  # torchrun, and each rank in its own session
        for pid in ranks:
            os.killpg(pid, signal.SIGKILL)
        group.wait(timeout=30)
        deadline = time.monotonic() + 30
        while not all(_gone(pid) for pid in ranks):
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        if group.poll() is None:
            os.killpg(group.pid, signal.SIGKILL)
        log.close()
    assert group.returncode == -signal.SIGKILL
    written = len(read_manifest(out)["shards"])
    assert 2 <= written < n, "the group should have been killed mid-build"

    rerun = subprocess.run(argv, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    lines = [ln for ln in rerun.stdout.splitlines() if ln.startswith("[cache] wrote")]
    assert len(lines) == 1 and "complete" in lines[0], rerun.stdout  # rank 0 alone reports
    keys = _keys(out)
    assert len(keys) == len(set(keys)) == n
    manifest = read_manifest(out)
    assert manifest["samples"] == n and manifest["complete"]
    verify = subprocess.run(
        _cli("verify", str(out)), cwd=ROOT, env=_env(), capture_output=True, text=True
    )
    assert verify.returncode == 0, verify.stderr
    assert f"{n} samples" in verify.stdout


def test_a_group_asked_for_outside_torchrun_exits_2_in_one_line(tmp_path):
    _setup(tmp_path, Path("unused"), 2)
    proc = subprocess.run(
        _cli("build", str(tmp_path / "run2.yaml"), "--out", str(tmp_path / "cache")),
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [
        "xtoken cache build: teacher.tensor_parallel=2 but this teacher group has WORLD_SIZE=1 "
        "processes; start it with torchrun --nproc-per-node 2, or set teacher.tensor_parallel: 1"
    ]
    assert not (tmp_path / "cache").exists()  # refused before anything is written
