"""Slot bookkeeping of a logit ring: which slots are free, published, released (pure, no I/O).

Legend: S slots.

``SlotTable`` works over an int64 tensor ``gens_2S``: row 0 is ``published_gen[S]`` (written
only by the ring's writer), row 1 is ``released_gen[S]`` (written only by the reader). In unit
tests it is a plain tensor; across processes it is a view of the ring's /dev/shm header, so the
two processes share it without locks or atomics: each word has one writer, and every read or
write of a word is one aligned 8-byte access.

The protocol, per slot ``s``:
  * free for the writer iff ``released_gen[s] == published_gen[s]`` (and the writer does not
    already hold it: ``acquire`` hands a slot out once, until ``publish`` or ``abandon``);
  * ``publish`` bumps ``published_gen[s]``; the new value is the handle's generation;
  * a handle ``(s, g)`` is valid iff ``g == published_gen[s] > released_gen[s]``;
  * ``release`` sets ``released_gen[s] = g`` (only for the current generation, so a stale or
    repeated release never frees a slot that another handle still reads).
"""

from __future__ import annotations

import torch

__all__ = ["SlotTable", "StaleHandleError"]


class StaleHandleError(RuntimeError):
    """A logit-ring handle that can no longer be read: its teacher died or closed the ring, the
    slot was released or overwritten, or the handle belongs to another ring instance.

    Retrying the same handle never helps; the caller recomputes the batch (asks the teacher
    again).
    """


def _check_int(name: str, value: object, lo: int, hi: int) -> int:
    if type(value) is not int or not lo <= value < hi:
        raise ValueError(f"{name}={value!r}: expected an int in [{lo}, {hi})")
    return value


class SlotTable:
    """Published/released generations of ``S`` slots over a shared int64 tensor ``[2, S]``.

    The writer side uses ``acquire`` / ``publish`` / ``abandon`` (and keeps which slots it holds
    locally); the reader side uses ``validate`` / ``release``. Both sides may build a
    ``SlotTable`` over the same shared tensor.

    Args:
        gens_2S: int64 tensor ``[2, S]`` on the CPU, ``S >= 1`` (row 0 published, row 1
            released); zeros for a new ring.

    Raises:
        ValueError: not a CPU int64 tensor of shape ``[2, S]``.
    """

    def __init__(self, gens_2S: torch.Tensor) -> None:
        if (
            not isinstance(gens_2S, torch.Tensor)
            or gens_2S.dtype != torch.int64
            or gens_2S.device.type != "cpu"
            or gens_2S.dim() != 2
            or gens_2S.shape[0] != 2
            or gens_2S.shape[1] < 1
        ):
            what = (
                f"{gens_2S.dtype} {list(gens_2S.shape)} on {gens_2S.device}"
                if isinstance(gens_2S, torch.Tensor)
                else type(gens_2S).__name__
            )
            raise ValueError(f"SlotTable needs a CPU int64 tensor [2, S>=1], got {what}")
        self.gens_2S = gens_2S
        self.published_S = gens_2S[0]
        self.released_S = gens_2S[1]
        self.num_slots = int(gens_2S.shape[1])
        self._held: set[int] = set()
        self._next = 0

    @classmethod
    def zeros(cls, num_slots: int) -> SlotTable:
        """A table of ``num_slots`` fresh slots (every slot free, generation 0).

        Raises:
            ValueError: ``num_slots`` is not a positive int.
        """
        _check_int("num_slots", num_slots, 1, 1 << 20)
        return cls(torch.zeros(2, num_slots, dtype=torch.int64))

    def _slot(self, slot: object) -> int:
        return _check_int("slot", slot, 0, self.num_slots)

    def published(self, slot: int) -> int:
        """``published_gen[slot]``: the generation of the slot's last publish (0: never)."""
        return int(self.published_S[self._slot(slot)])

    def released(self, slot: int) -> int:
        """``released_gen[slot]``: the generation the reader released last (0: never)."""
        return int(self.released_S[self._slot(slot)])

    def is_free(self, slot: int) -> bool:
        """True when the writer may take ``slot``: released up to its last publish, not held."""
        slot = self._slot(slot)
        return slot not in self._held and self.released(slot) == self.published(slot)

    def held(self) -> list[int]:
        """The slots the writer acquired and has not yet published or abandoned."""
        return sorted(self._held)

    def in_flight(self) -> list[int]:
        """The slots published and not yet released (a reader may be reading them)."""
        return [s for s in range(self.num_slots) if self.released(s) != self.published(s)]

    def acquire(self) -> int | None:
        """Writer: take a free slot (round robin, so slots are reused oldest-first).

        Returns:
            The slot, now held by the writer until ``publish`` or ``abandon``; None when no
            slot is free (every slot is held or published and not released).
        """
        for i in range(self.num_slots):
            slot = (self._next + i) % self.num_slots
            if self.is_free(slot):
                self._held.add(slot)
                self._next = (slot + 1) % self.num_slots
                return slot
        return None

    def check_held(self, slot: object) -> int:
        """Return ``slot`` if the writer holds it.

        Raises:
            ValueError: ``slot`` out of range or not acquired (writing into a published slot
                would change logits that a reader may be reading).
        """
        slot = self._slot(slot)
        if slot not in self._held:
            raise ValueError(
                f"slot {slot} is not held by the writer (held: {self.held()}); call acquire() "
                "and use the slot it returns"
            )
        return slot

    def publish(self, slot: int) -> int:
        """Writer: publish a held slot (``published_gen[slot] += 1``).

        Args:
            slot: a slot from ``acquire``, fully written.

        Returns:
            The new generation (``>= 1``): what the handle carries.

        Raises:
            ValueError: ``slot`` is not held.
        """
        slot = self.check_held(slot)
        generation = self.published(slot) + 1
        self.published_S[slot] = generation
        self._held.discard(slot)
        return generation

    def abandon(self, slot: int) -> None:
        """Writer: give back a held slot without publishing it (its generation is unchanged).

        Raises:
            ValueError: ``slot`` is not held.
        """
        self._held.discard(self.check_held(slot))

    def validate(self, slot: int, generation: int) -> None:
        """Reader: check that handle ``(slot, generation)`` may be read.

        Raises:
            ValueError: ``slot`` or ``generation`` is not an int in range (a malformed handle).
            StaleHandleError: the slot was overwritten, released, or never published with this
                generation.
        """
        slot = self._slot(slot)
        _check_int("generation", generation, 1, 1 << 62)
        published, released = self.published(slot), self.released(slot)
        if generation != published:
            why = "overwritten by a newer batch" if generation < published else "never published"
            raise StaleHandleError(
                f"logit ring slot {slot} is at generation {published}, the handle has "
                f"{generation}: {why}; recompute the batch"
            )
        if released >= generation:
            raise StaleHandleError(
                f"logit ring slot {slot} generation {generation} was already released; a handle "
                "is read once, recompute the batch"
            )

    def release(self, slot: int, generation: int) -> bool:
        """Reader: hand slot ``slot`` back to the writer (``released_gen[slot] = generation``).

        Only the current generation is released; releasing a stale handle or the same handle
        twice changes nothing, so a release in a ``finally`` can never free a slot that a newer
        handle refers to.

        Returns:
            True when this call released the slot, False when there was nothing to release.

        Raises:
            ValueError: ``slot`` or ``generation`` is not an int in range.
        """
        slot = self._slot(slot)
        _check_int("generation", generation, 1, 1 << 62)
        if self.published(slot) != generation or self.released(slot) >= generation:
            return False
        self.released_S[slot] = generation
        return True

    def __repr__(self) -> str:
        return (
            f"SlotTable(published={self.published_S.tolist()}, "
            f"released={self.released_S.tolist()}, held={self.held()})"
        )
