"""SlotTable: the logit ring's acquire / publish / release / validate protocol, without processes."""

from __future__ import annotations

import pytest
import torch

from xtoken_core.ipc import SlotTable, StaleHandleError


def test_acquire_hands_out_each_free_slot_once_then_none():
    table = SlotTable.zeros(3)
    assert [table.acquire() for _ in range(3)] == [0, 1, 2]
    assert table.acquire() is None
    assert table.held() == [0, 1, 2]


def test_a_published_slot_is_reused_only_after_its_release():
    table = SlotTable.zeros(2)
    a, b = table.acquire(), table.acquire()
    gen_a, gen_b = table.publish(a), table.publish(b)
    assert (gen_a, gen_b) == (1, 1)
    assert table.acquire() is None and table.in_flight() == [0, 1]
    assert table.release(b, gen_b) is True
    assert table.acquire() == b
    assert table.publish(b) == 2
    assert table.published(b) == 2 and table.released(b) == 1


def test_acquire_goes_round_robin_so_the_oldest_released_slot_comes_first():
    table = SlotTable.zeros(3)
    for _ in range(3):
        slot = table.acquire()
        table.release(slot, table.publish(slot))
    assert [table.acquire() for _ in range(3)] == [0, 1, 2]


def test_validate_accepts_only_the_current_unreleased_generation():
    table = SlotTable.zeros(2)
    slot = table.acquire()
    gen = table.publish(slot)
    table.validate(slot, gen)
    with pytest.raises(StaleHandleError, match="never published"):
        table.validate(slot, gen + 1)
    table.release(slot, gen)
    with pytest.raises(StaleHandleError, match="already released"):
        table.validate(slot, gen)
    assert table.acquire() == 1  # round robin: slot 1 first, then slot 0 again
    assert table.acquire() == slot
    new = table.publish(slot)
    with pytest.raises(StaleHandleError, match="overwritten"):
        table.validate(slot, gen)
    table.validate(slot, new)


def test_release_of_a_stale_or_repeated_handle_changes_nothing():
    table = SlotTable.zeros(2)
    slot = table.acquire()
    old = table.publish(slot)
    assert table.release(slot, old) is True
    assert table.release(slot, old) is False  # twice: no-op
    table.acquire()
    table.acquire()
    new = table.publish(slot)
    assert table.release(slot, old) is False  # the stale handle must not free the new batch
    assert table.release(slot, new + 5) is False  # a future generation: never written
    assert not table.is_free(slot) and table.released(slot) == old
    assert table.release(slot, new) is True and table.is_free(slot)


def test_publish_and_abandon_need_a_held_slot():
    table = SlotTable.zeros(2)
    with pytest.raises(ValueError, match="not held"):
        table.publish(0)
    slot = table.acquire()
    table.abandon(slot)
    assert table.is_free(slot) and table.published(slot) == 0
    with pytest.raises(ValueError, match="not held"):
        table.abandon(slot)


def test_two_tables_over_one_tensor_see_each_others_words():
    shared_2S = torch.zeros(2, 4, dtype=torch.int64)
    writer, reader = SlotTable(shared_2S), SlotTable(shared_2S)
    slot = writer.acquire()
    gen = writer.publish(slot)
    reader.validate(slot, gen)
    assert writer.acquire() == 1 and not writer.is_free(slot)
    reader.release(slot, gen)
    assert writer.is_free(slot)
    assert shared_2S.tolist() == [[1, 0, 0, 0], [1, 0, 0, 0]]


@pytest.mark.parametrize(
    "slot, generation, match",
    [(2, 1, "slot=2"), (-1, 1, "slot=-1"), ("0", 1, "slot='0'"), (0, 0, "generation=0")],
)
def test_malformed_slot_or_generation_raise_value_error(slot, generation, match):
    table = SlotTable.zeros(2)
    with pytest.raises(ValueError, match=match):
        table.validate(slot, generation)
    with pytest.raises(ValueError, match=match):
        table.release(slot, generation)


@pytest.mark.parametrize(
    "tensor",
    [torch.zeros(2, 3, dtype=torch.int32), torch.zeros(3, 2, dtype=torch.int64), torch.zeros(2, 0)],
)
def test_table_needs_an_int64_tensor_of_two_rows(tensor):
    with pytest.raises(ValueError, match=r"int64 tensor \[2, S>=1\]"):
        SlotTable(tensor)
