"""Key tombstones: a compact, bounded set of the keys a partition dropped after consumption.

Retention drops a sample once every task registered for its partition consumed it (store.py);
its key is remembered here so that a producer that puts it again (a restarted collator) is
told "already consumed" instead of re-feeding consumers. A key costs 8 bytes: the set holds
64-bit hashes (blake2b), never the key strings, in a few sorted int64 arrays merged like a
binary counter (an insert is amortized O(log n), a lookup one binary search per array).

Two honest limits, both documented in proto/PROTOCOL.md:
* a hash collision makes a fresh key look consumed: with n tombstones a fresh key collides with
  probability about n / 2**64 (1e-12 at 10 million keys);
* at most ``max_keys`` hashes are kept; past it the oldest array (at most a quarter of them) is
  forgotten, and a re-put of a key consumed that long ago is stored again.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable, Sequence

import torch

from services.queue.config import DEFAULT_MAX_KEYS

logger = logging.getLogger(__name__)

# Hashes buffered in a Python set before they become a sorted array.
_BUFFER = 4096


def key_hash(key: str) -> int:
    """The signed 64-bit hash a tombstone stores for ``key``."""
    digest = hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


class KeyTombstones:
    """A set of key hashes with add / contains / len, at most ``max_keys`` hashes.

    Args:
        max_keys: most hashes kept (>= 1); past it the oldest are forgotten.

    Raises:
        ValueError: ``max_keys`` < 1.
    """

    def __init__(self, max_keys: int = DEFAULT_MAX_KEYS) -> None:
        if max_keys < 1:
            raise ValueError(f"max_keys={max_keys}: must be >= 1 (--tombstones)")
        self.max_keys = int(max_keys)
        self._recent: set[int] = set()
        self._levels: list[torch.Tensor] = []  # sorted int64 arrays, oldest (largest) first
        self.forgotten = 0

    def __len__(self) -> int:
        return len(self._recent) + sum(int(a.numel()) for a in self._levels)

    @property
    def nbytes(self) -> int:
        """Bytes of the sorted arrays (the buffered set is at most a few thousand keys)."""
        return sum(int(a.numel()) * 8 for a in self._levels) + 8 * len(self._recent)

    def add(self, keys: Iterable[str]) -> None:
        """Remember ``keys`` (keys already present are harmless)."""
        for k in keys:
            self._recent.add(key_hash(k))
        if len(self._recent) >= _BUFFER:
            self._flush()

    def contains(self, keys: Sequence[str]) -> list[bool]:
        """For each key, whether it was added (and not forgotten since)."""
        if not keys:
            return []
        hashes = [key_hash(k) for k in keys]
        found = [h in self._recent for h in hashes]
        if self._levels:
            h = torch.tensor(hashes, dtype=torch.int64)
            hit = torch.zeros(len(hashes), dtype=torch.bool)
            for level in self._levels:
                idx = torch.searchsorted(level, h).clamp_(max=level.numel() - 1)
                hit |= level[idx] == h
            found = [a or b for a, b in zip(found, hit.tolist())]
        return found

    def export(self) -> torch.Tensor:
        """Every remembered hash as one int64 tensor, oldest first (the durable log's snapshot)."""
        recent = torch.tensor(sorted(self._recent), dtype=torch.int64)
        return torch.cat([*self._levels, recent]) if self._levels else recent

    def restore(self, hashes: torch.Tensor) -> None:
        """Remember ``hashes`` (from ``export``) as the oldest entries, before any added since."""
        if hashes.numel():
            self._levels.insert(0, torch.unique(hashes.to(torch.int64)))

    def _flush(self) -> None:
        level = torch.tensor(sorted(self._recent), dtype=torch.int64)
        self._recent.clear()
        self._levels.append(level)
        # Binary counter: merge while the newer array is at least as large as the one before it,
        # up to a quarter of the bound, so that arrays stay in age order and forgetting the
        # oldest one past the bound forgets at most a quarter of the keys.
        cap = max(self.max_keys // 4, _BUFFER)
        levels = self._levels
        while (
            len(levels) >= 2
            and levels[-1].numel() >= levels[-2].numel()
            and levels[-1].numel() + levels[-2].numel() <= cap
        ):
            newer = self._levels.pop()
            older = self._levels.pop()
            self._levels.append(torch.unique(torch.cat([older, newer])))  # sorted, deduplicated
        while len(self) > self.max_keys and self._levels:
            dropped = self._levels.pop(0)
            self.forgotten += int(dropped.numel())
            logger.warning(
                "[queue] tombstones past --tombstones %d: the %d oldest consumed keys are "
                "forgotten (a re-put of one of them is stored again)",
                self.max_keys,
                dropped.numel(),
            )
