"""``xtoken run`` trained from a teacher cache that ``xtoken cache build`` wrote, as real
processes: no teacher process starts, the run completes, every sample is trained exactly once
with a KD term from the cached targets; a cache of another teacher is refused before any
process starts, in one line naming the key that differs. With ``data.teacher_cache_missing:
online`` a cache of half the corpus serves a run over all of it: the run starts the teacher,
which serves exactly the samples the cache lacks, and every sample is trained exactly once, also
when that teacher is SIGKILLed and restarted."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import subprocess
import sys

import pytest

from services.common.metrics import read_jsonl
from tests.e2e.conftest import (
    CHILD_ENV,
    assert_exactly_once,
    corpus_parts,
    feed_totals,
    step_records,
    tiny_run_config,
    trained_keys,
    wait_for,
    write_config,
)


def _xtoken(*argv: str, timeout: float = 240) -> subprocess.CompletedProcess:
    import os

    env = {**os.environ, **CHILD_ENV}
    return subprocess.run(
        [sys.executable, "-m", "services.cli", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_run_from_a_built_cache_starts_no_teacher_and_trains_each_sample_once(
    procs, tmp_path, demo, projection
):
    paths, corpus = corpus_parts(demo, tmp_path / "data", n=24, parts=1)
    run_dir = tmp_path / "run"
    cache = tmp_path / "cache"
    config = tiny_run_config(run_dir, paths[0], str(demo.heldout_path), projection)
    config = dataclasses.replace(
        config, data=dataclasses.replace(config.data, teacher_cache=str(cache))
    )
    path = write_config(tmp_path / "run.json", config)
    built = _xtoken("cache", "build", str(path), "--out", str(cache), "--no-progress")
    assert built.returncode == 0, built.stderr

    run = procs.start("run", ["run", str(path), "--no-progress"], ready=False)
    assert run.wait(240) == 0, run.tail()

    assert_exactly_once(trained_keys(run_dir), corpus)
    assert not list((run_dir / "logs").glob("*teacher*")), "a teacher process started"
    assert not (run_dir / "config" / "teacher0.json").exists()
    for rank in (0, 1):
        steps = step_records(run_dir, rank)
        assert steps, f"rank {rank} recorded no step"
        for record in steps:
            assert math.isfinite(record["kl_loss"]) and record["kl_loss"] > 0, record

    other = _xtoken(
        "run", str(path), "--no-progress", "--set", f"run_dir={tmp_path / 'other'}",
        "--set", "teacher.seed=7",
    )  # fmt: skip
    assert other.returncode == 2, other.stderr
    assert "teacher.weights_hash" in other.stderr and "was built for another teacher" in (
        other.stderr
    ), other.stderr
    assert not (tmp_path / "other" / "logs").exists() or not list(
        (tmp_path / "other" / "logs").iterdir()
    )


def _online_half_cache(tmp_path, demo, projection):
    """A run config over 24 texts with ``teacher_cache_missing: online`` and a cache built by
    builder 0 of 2 alone (about half the texts, spread over the corpus); returns the config's
    path, its run folder, the corpus keys and the keys the cache lacks."""
    from xtoken_core.cache.reader import CacheReader

    paths, corpus = corpus_parts(demo, tmp_path / "data", n=24, parts=1)
    run_dir = tmp_path / "run"
    cache = tmp_path / "cache"
    config = tiny_run_config(run_dir, paths[0], str(demo.heldout_path), projection)
    data = dataclasses.replace(
        config.data, teacher_cache=str(cache), teacher_cache_missing="online"
    )
    path = write_config(tmp_path / "run.json", dataclasses.replace(config, data=data))
    built = _xtoken("cache", "build", str(path), "--out", str(cache), "--shard", "0/2",
                    "--no-progress")  # fmt: skip
    assert built.returncode == 0, built.stderr
    missing = CacheReader(cache).missing(corpus)
    assert 0 < len(missing) < len(corpus), missing
    return path, run_dir, corpus, missing


@pytest.mark.slow
@pytest.mark.timeout(500)
def test_online_a_cache_of_half_the_corpus_serves_a_run_over_all_of_it_beside_the_live_teacher(
    procs, tmp_path, demo, projection
):
    path, run_dir, corpus, missing = _online_half_cache(tmp_path, demo, projection)

    run = procs.start("run", ["run", str(path), "--no-progress"], ready=False)
    assert run.wait(400) == 0, run.tail()

    assert_exactly_once(trained_keys(run_dir), corpus)
    assert (run_dir / "config" / "teacher0.json").exists(), "the live teacher did not start"
    assert f"by its live groups for the {len(missing)} it lacks" in run.log(), run.tail()
    # the live teacher served the samples the cache lacks, each once, and nothing else
    totals = feed_totals(run_dir)
    assert totals["cache_missing"] == len(missing), totals
    served = read_jsonl(run_dir / "metrics" / "teacher.group0.jsonl")
    rows = sum(r["rows"] for r in served if r.get("event") == "request")
    assert rows == len(missing) and totals["re_requests"] == 0, (rows, totals)
    for rank in (0, 1):
        steps = step_records(run_dir, rank)
        assert steps, f"rank {rank} recorded no step"
        for record in steps:
            assert math.isfinite(record["kl_loss"]) and record["kl_loss"] > 0, record


@pytest.mark.slow
@pytest.mark.timeout(500)
def test_online_a_sigkilled_live_teacher_is_restarted_and_no_sample_is_lost_or_trained_twice(
    procs, tmp_path, demo, projection
):
    path, run_dir, corpus, missing = _online_half_cache(tmp_path, demo, projection)

    run = procs.start("run", ["run", str(path), "--no-progress"], ready=False)
    ready = run_dir / "ready" / "teacher0"
    first = wait_for(lambda: ready.exists() and json.loads(ready.read_text())["pid"], 300,
                     "the live teacher's ready file")  # fmt: skip
    os.kill(first, signal.SIGKILL)
    assert run.wait(400) == 0, run.tail()

    assert_exactly_once(trained_keys(run_dir), corpus)
    # its log, appended across restarts, says "serving" once per start
    starts = (run_dir / "logs" / "teacher0.log").read_text().count(" serving ")
    assert starts >= 2, f"the live teacher was not restarted ({starts} start)"
    # every sample the cache lacks was trained once on live logits, of the restarted teacher
    assert feed_totals(run_dir)["cache_missing"] == len(missing)
