"""The teacher cache: sparse teacher targets of a corpus on disk (Parquet shards and a JSON
manifest), written once by ``xtoken cache build`` and read by any number of runs.

* :mod:`.format`: the row schema and the codecs of the top-K payload (ids, log-probs);
* :mod:`.manifest`: the manifest (fingerprint, counts, per-shard checksums) and its updates;
* :mod:`.writer`: shards written whole and renamed into place (a crash leaves none half-written);
* :mod:`.reader`: the targets of a sample by its key;
* :mod:`.verify`: every shard checked against the manifest, a damaged one named with its offset.
"""
