"""Test helper: a deterministic TensorDict of every leaf kind, and a writer process that puts it.

``python -m tests.services.queue.tensordicts ADDRESS PARTITION SEED`` puts ``sample(SEED)``
under ``keys(SEED)`` and exits 0: the writer of the cross-process tests.
"""

from __future__ import annotations

import sys

import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict

LENGTHS = (5, 0, 3, 1500)


def keys(seed: int) -> list[str]:
    """The keys ``sample(seed)`` is put under."""
    return [f"s{seed}-{i}" for i in range(len(LENGTHS))]


def sample(seed: int) -> TensorDict:
    """Jagged (int64 ids, float32 [L, 4] hidden), dense, NonTensorStack and NonTensorData."""
    g = torch.Generator().manual_seed(seed)
    n = len(LENGTHS)

    def jagged(rows):
        return torch.nested.nested_tensor(rows, layout=torch.jagged)

    td = TensorDict(
        {
            "input_ids": jagged([torch.randint(0, 50_000, (k,), generator=g) for k in LENGTHS]),
            "hidden": jagged([torch.randn(k, 4, generator=g) for k in LENGTHS]),
            "input_lengths": torch.tensor(LENGTHS),
            "reward": torch.randn(n, generator=g),
            "meta": NonTensorStack(
                *(
                    NonTensorData(o)
                    for o in ({"id": 0, "tags": ["a"]}, None, "text", [1, 2.5, b"\x00"])
                )
            ),
        },
        batch_size=[n],
    )
    td.set_non_tensor("source", f"corpus-{seed}")
    return td


def assert_rows_equal(got: TensorDict, want: TensorDict, order: list[int]) -> None:
    """``got`` holds ``want``'s rows ``order``, leaf for leaf (a claim picks its own order)."""
    assert got.batch_size == torch.Size([len(order)])
    assert sorted(got.keys()) == sorted(want.keys())
    for name in ("input_ids", "hidden"):
        g, w = got.get(name), want.get(name)
        assert g.is_nested and g.layout == torch.jagged, name
        w_rows = list(w.unbind(0))
        for row, i in zip(g.unbind(0), order, strict=True):
            assert row.dtype == w_rows[i].dtype and torch.equal(row, w_rows[i]), name
    for name in ("input_lengths", "reward"):
        assert torch.equal(got.get(name), want.get(name)[order]), name
    assert got.get("meta").tolist() == [want.get("meta").tolist()[i] for i in order]
    assert isinstance(got.get("source"), NonTensorData)
    assert got.get_non_tensor("source") == want.get_non_tensor("source")


def main(argv: list[str]) -> int:
    from services.queue.client import QueueClient

    address, partition, seed = argv[0], argv[1], int(argv[2])
    with QueueClient(address, timeout_s=30, shm="never") as client:
        reply = client.put(partition, keys(seed), sample(seed))
    return 0 if reply["new_samples"] == len(LENGTHS) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
