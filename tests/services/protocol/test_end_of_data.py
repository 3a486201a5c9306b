"""The end-of-data marker: its record round trips into the meta partition."""

from __future__ import annotations

from services.protocol import end_of_data, names


def test_the_marker_fields_carry_the_sample_count():
    fields = end_of_data.eof_fields(1234)
    assert fields["samples"].shape == (1, 1)
    assert end_of_data.eof_samples(fields) == 1234


def test_put_eof_puts_the_marker_into_the_meta_partition():
    puts = []

    class Client:
        def put(self, partition, keys, fields):
            puts.append((partition, keys, end_of_data.eof_samples(fields)))

    end_of_data.put_eof(Client(), "train", 7)
    assert puts == [(names.meta_partition("train"), [end_of_data.EOF_KEY], 7)]
    assert names.meta_partition("train") == "train.meta"
