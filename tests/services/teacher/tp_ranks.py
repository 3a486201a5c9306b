"""The ranks of tensor-parallel teacher groups that the tests spawn (an importable module: the
spawned processes unpickle these functions by name)."""

from __future__ import annotations

import gc
import os
import socket
import sys
import traceback
from pathlib import Path
from typing import Any

import torch

# the GPU group's tokenizer: one the base install ships (no optional package on a bare machine)
TOKENIZER = "qwen3"


def free_port() -> int:
    """A loopback port free now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_group(fn, size: int, *args: Any, device: str = "cpu") -> None:
    """Run ``fn(rank, size, *args)`` in ``size`` spawned processes joined as torchrun would
    (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``); raises the
    first rank's failure."""
    import torch.multiprocessing as mp

    port = free_port()
    mp.spawn(_rank_main, args=(size, port, fn, args), nprocs=size, join=True)


def _rank_main(rank: int, size: int, port: int, fn, args) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
    )  # fmt: skip
    torch.set_num_threads(1)
    import torch.distributed as dist

    try:
        fn(rank, size, *args)
        if dist.is_initialized():
            dist.barrier()  # every rank is done with the group before any leaves it
    except BaseException:
        traceback.print_exc()
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # A clean exit without interpreter finalization: gloo's worker threads, still referenced by
    # the sharded model's DTensors, can abort the process (SIGABRT, "terminate called without an
    # active exception") when finalization destroys them; the rank's work is saved by now.
    gc.collect()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _requests(width: int, pad_id: int):
    """Two requests of trainer ranks 0 and 1: a padded row, a full row, another length."""
    from services import protocol as proto

    g = torch.Generator().manual_seed(5)
    rows0 = [torch.randint(0, width, (n,), generator=g) for n in (11, 6)]
    rows1 = [torch.randint(0, width, (7,), generator=g)]
    return [
        proto.decode_request("a:0", proto.request_fields(rows0, 0), 0, pad_id),
        proto.decode_request("b:0", proto.request_fields(rows1, 1), 0, pad_id),
    ]


def serve_whole_then_sharded(rank: int, size: int, transport: str, out: str) -> None:
    """Every rank loads the tiny preset whole (seed 3), the group shards it and serves two
    requests; rank 0 saves what the trainer reads (ring views or hidden states), the gathered
    logits of ``logits()``, the held-out bits/byte, and a one-process teacher's of the same
    weights, to ``out``."""
    from services import protocol as proto
    from services.teacher.config import TeacherConfig
    from services.teacher.tensor_parallel import TeacherGroup, TensorParallelTeacher
    from services.teacher.worker import TeacherWorker
    from xtoken_core.ipc.logit_ring import LogitRingReader
    from xtoken_core.models import load_model

    config = TeacherConfig(
        model="tiny", tokenizer="smollm2", max_batch=2, max_length=12, seed=3,
        transport=transport, tensor_parallel=size, forward_rows=8,
    )  # fmt: skip
    group = TeacherGroup.start(config)
    model = load_model("tiny", vocab_size=49152, seed=3)
    texts = ["The quick brown fox jumps over the lazy dog.", "Pack my box with five dozen jugs."]
    with TensorParallelTeacher(config, group, model=model) as worker:
        bpb = worker.evaluate(texts)
        if rank != 0:
            requests = _requests(worker.width, worker.pad_id)
            worker.logits(requests[0])  # rank 0's gather below needs every rank
            worker.follow()
            return
        requests = _requests(worker.width, worker.pad_id)
        gathered = worker.logits(requests[0]).float()
        fields = worker.compute_many(requests)
        saved: dict[str, Any] = {"bpb": bpb["bits_per_byte"], "gathered": gathered}
        with LogitRingReader() as reader:
            for request, f in zip(requests, fields, strict=True):
                result = proto.Result.from_blob(f[proto.result_field(request.rank)], request.key)
                assert result.error is None, result.error
                B, U = request.ids_BU.shape
                if transport == "hidden":
                    got = proto.hidden_from_column(f[proto.hidden_field(request.rank)], B, U, "k")
                elif transport == "topk":  # the trainer's decode of the group's targets
                    from xtoken_core.wire.topk import decode_topk

                    columns = [f[name] for name in proto.topk_fields(request.rank)]
                    targets = proto.topk_from_columns(columns, B, U, request.key)
                    got = decode_topk(targets, result.width)
                else:
                    got = reader.view(result.descriptor, result.handle).clone()
                    reader.release(result.descriptor, result.handle)
                saved[request.key] = got.float()
    one_config = TeacherConfig(
        model="tiny", tokenizer="smollm2", max_batch=2, max_length=12, seed=3, forward_rows=8
    )
    with TeacherWorker(one_config, model=load_model("tiny", vocab_size=49152, seed=3)) as one:
        saved["one_bpb"] = one.evaluate(texts)["bits_per_byte"]
        for request in requests:
            saved[f"one:{request.key}"] = one.logits(request).float()
            if transport == "topk":  # the one-process teacher's targets, decoded alike
                from xtoken_core.wire.topk import decode_topk, encode_topk

                targets = encode_topk(one.logits(request), config.top_k)
                saved[f"one_topk:{request.key}"] = decode_topk(targets, one.width).float()
            saved[f"one_hidden:{request.key}"] = one.hidden_states(request).float()
    torch.save(saved, out)


def build_preset_shards(rank: int, size: int, shape: dict, seed: int, out: str) -> None:
    """Build a preset of ``shape`` (a scaled-down Qwen2 config's fields) on the meta device,
    shard by shard, twice with ``seed`` and once with ``seed + 1``; save each rank's local
    shards, their shapes, and the logits of one forward."""
    from transformers import Qwen2Config

    from services.teacher.config import TeacherConfig
    from services.teacher.shards import _local, init_shards, tensor_parallel_plan
    from services.teacher.shards import _meta_model as meta_model
    from services.teacher.tensor_parallel import TeacherGroup

    config = Qwen2Config(**shape)
    group = TeacherGroup.start(TeacherConfig(tensor_parallel=size, model="tiny"), config)
    saved: dict[str, Any] = {}
    for run, s in (("a", seed), ("b", seed), ("c", seed + 1)):
        model = meta_model(config, group.mesh, torch.float32, group.device)
        assert not any(p.is_meta for p in model.parameters())
        init_shards(model, s, rank)
        saved[run] = {n: _local(p)[0].clone() for n, p in model.named_parameters()}
        ids = torch.arange(12).reshape(2, 6) % shape["vocab_size"]
        with torch.inference_mode():
            saved[f"logits_{run}"] = model(ids).logits.float()
    saved["plan"] = sorted(tensor_parallel_plan(model))
    saved["tied_head"] = config.tie_word_embeddings
    torch.save(saved, Path(out) / f"rank{rank}.pt")


def meta_shards(rank: int, size: int, preset: str, vocab: int, out: str) -> None:
    """Parallelize ``preset`` on the meta device over the group; save each rank's local shapes,
    its local parameter count, the whole count, the norms' count and whether all is meta."""
    from transformers import AutoModelForCausalLM

    from services.teacher.config import TeacherConfig
    from services.teacher.shards import _local, _parallelize
    from services.teacher.tensor_parallel import TeacherGroup
    from xtoken_core.models.presets import PRESETS

    config = PRESETS[preset].config(vocab)
    group = TeacherGroup.start(TeacherConfig(tensor_parallel=size, model=preset), config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    whole = sum(p.numel() for p in model.parameters())
    model = _parallelize(model, group.mesh)
    locals_ = {n: _local(p)[0] for n, p in model.named_parameters()}
    torch.save(
        {
            "all_meta": all(t.is_meta for t in locals_.values()),
            "shapes": {n: tuple(t.shape) for n, t in locals_.items()},
            "local": sum(t.numel() for t in locals_.values()),
            "whole": whole,
            "norms": sum(t.numel() for n, t in locals_.items() if "norm" in n),
        },
        Path(out) / f"meta{rank}.pt",
    )


def serve_cuda_ipc_group(rank: int, size: int, out: str) -> None:
    """Two GPUs (NCCL, ``cuda_ipc``): the tiny preset (seed 3) loaded whole and sharded serves a
    request through both ranks' columns of a ring slot on rank 0's GPU; then the qwen3-1.7b
    preset, built shard by shard on each GPU, serves one. Rank 0 saves what it read, a
    one-process teacher's logits of the tiny preset, and whether the layers stayed compiled."""
    from services import protocol as proto
    from services.teacher.config import TeacherConfig
    from services.teacher.tensor_parallel import TeacherGroup, TensorParallelTeacher
    from services.teacher.worker import TeacherWorker
    from xtoken_core.ipc.logit_ring import LogitRingReader
    from xtoken_core.models import load_model
    from xtoken_core.tokenizers import load_tokenizer

    common = dict(
        tokenizer=TOKENIZER, device="cuda", transport="cuda_ipc", max_batch=2, max_length=64,
        tensor_parallel=size, checksum=True,
    )  # fmt: skip
    config = TeacherConfig(model="tiny", seed=3, **common)
    group = TeacherGroup.start(config)
    saved: dict[str, Any] = {}
    for name, model in (
        (
            "tiny",
            load_model(
                "tiny",
                vocab_size=load_tokenizer(TOKENIZER).vocab_size,
                seed=3,
                dtype=torch.bfloat16,
            ),
        ),
        ("qwen3-1.7b", None),
    ):
        cfg = TeacherConfig(model=name, seed=3, **common)
        with TensorParallelTeacher(cfg, group, model=model) as worker:
            if rank != 0:
                worker.follow()
                continue
            request = _requests(worker.width, worker.pad_id)[0]
            result = proto.Result.from_blob(
                worker.compute(request)[proto.result_field(0)], request.key
            )
            assert result.error is None, result.error
            with LogitRingReader(device="cuda:0") as reader:
                view = reader.view(result.descriptor, result.handle)
                saved[f"{name}:verified"] = reader.verify(view, result.handle)
                saved[name] = view.float().cpu()
                reader.release(result.descriptor, result.handle)
            saved[f"{name}:compiled"] = worker.compiled.active
    if rank == 0:
        one_config = TeacherConfig(
            model="tiny", seed=3, tokenizer=TOKENIZER, device="cuda:0", max_batch=2, max_length=64
        )
        # the group's weights (drawn on the CPU: a preset built on a cuda device draws others)
        tiny = load_model(
            "tiny", vocab_size=load_tokenizer(TOKENIZER).vocab_size, seed=3, dtype=torch.bfloat16
        )
        with TeacherWorker(one_config, model=tiny.to("cuda:0")) as one:
            saved["one:tiny"] = one.logits(_requests(one.width, one.pad_id)[0]).float().cpu()
        torch.save(saved, out)
