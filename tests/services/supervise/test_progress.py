"""The run's progress: plain periodic lines (no carriage return) when the stream is no terminal,
a tqdm bar redrawn in place on one; start-up phases; the total of a run that ends with its data."""

from __future__ import annotations

import io
import json

import pytest

from services.supervise.progress import RunProgress, count_texts, estimated_steps


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def step(metrics, n: int, *, at: float, loss: float = 4.0) -> None:
    record = {
        "event": "step",
        "time": at,
        "step": n,
        "loss": loss,
        "kl_loss": loss - 1,
        "ce_loss": loss + 1,
        "tokens_per_s": 800.0,
        "step_s": 2.0,
    }
    with open(metrics, "a") as f:
        f.write(json.dumps(record) + "\n")


def event(metrics, name: str, **fields) -> None:
    with open(metrics, "a") as f:
        f.write(json.dumps({"event": name, **fields}) + "\n")


def test_a_stream_that_is_no_terminal_gets_a_plain_line_every_interval(tmp_path):
    metrics, out, clock = tmp_path / "rank0.jsonl", io.StringIO(), Clock()
    progress = RunProgress(metrics, 10, stream=out, every_s=5.0, clock=clock, since=0)
    progress.update()  # t=0: the first line
    for n in range(1, 6):  # a step every 2 s of wall time
        clock.now = float(n)
        step(metrics, n, at=100.0 + 2 * n)
        progress.update()
    clock.now = 6.0
    progress.update()  # 5 s after the line of the first step
    lines = out.getvalue().splitlines(keepends=True)
    assert "\r" not in out.getvalue()
    assert all(line.endswith("\n") and line.startswith("[run] ") for line in lines)
    # the start, the first step (a new phase), then one line 5 s later; none in between
    assert len(lines) == 3, lines
    assert lines[0].startswith("[run] waiting for the first step: step 0/10")
    assert lines[1].startswith("[run] training: step 1/10")
    last = lines[2]
    assert "step 5/10 (50%)" in last
    assert "loss 4.0000 (kd 3.0000 ce 5.0000), 800 tok/s" in last
    assert "ETA 00:10" in last  # 5 steps left at 0.5 steps/s (2 s apart)


def test_closing_writes_the_last_state_on_its_own_line(tmp_path):
    metrics, out = tmp_path / "rank0.jsonl", io.StringIO()
    progress = RunProgress(metrics, 3, stream=out, every_s=60.0, clock=Clock(), since=0)
    progress.update()
    step(metrics, 3, at=10.0)
    progress.close()
    progress.close()  # once
    lines = out.getvalue().splitlines(keepends=True)
    assert len(lines) == 2 and all(line.endswith("\n") for line in lines)
    assert "\r" not in out.getvalue()
    assert "step 3/3 (100%)" in lines[-1]


def test_a_terminal_gets_a_bar_redrawn_in_place(tmp_path):
    metrics, out = tmp_path / "rank0.jsonl", FakeTerminal()
    progress = RunProgress(metrics, 8, stream=out, since=0)
    progress.update()
    for n in (1, 2, 3):
        step(metrics, n, at=float(n))
        progress.update()
    progress.close()
    text = out.getvalue()
    assert text.count("\r") >= 4  # every update redraws the same line
    frames = [frame for frame in text.split("\r") if frame.strip()]
    assert frames[-1].startswith("training:  38%|") and "3/8 steps" in frames[-1]
    assert "loss 4.0000 (kd 3.0000 ce 5.0000), 800 tok/s" in frames[-1]
    assert "<00:05" in frames[-1]  # ETA: 5 steps left at 1 step/s
    assert text.endswith("\n")


def test_the_start_up_phases_are_named_in_order(tmp_path):
    metrics = tmp_path / "rank0.jsonl"
    teacher, student = tmp_path / "ready" / "teacher0", tmp_path / "ready" / "trainer0"
    progress = RunProgress(
        metrics,
        2,
        stream=io.StringIO(),
        teacher_ready=[teacher],
        student_ready=student,
        dequantizes=True,
        total_is_exact=True,
    )

    def phase() -> str:
        progress.update()
        return progress.phase()

    assert phase() == "loading the teacher (dequantizing the GGUF, first run only)"
    teacher.parent.mkdir()
    teacher.write_text("{}")
    assert phase() == "loading the student"
    student.write_text("{}")
    assert phase() == "waiting for the first step"
    event(metrics, "compile", state="start")
    assert phase() == "compiling the student..."
    event(metrics, "compile", state="done", seconds=3.0)
    assert phase() == "waiting for the first step"
    step(metrics, 1, at=1.0)
    assert phase() == "training"
    step(metrics, 2, at=2.0)
    assert phase() == "finishing (checkpoint, held-out score, export)"
    progress.note("stopping: the trainers checkpoint")
    assert progress.phase() == "stopping: the trainers checkpoint"


def test_a_teacher_without_dequantization_is_just_loading(tmp_path):
    progress = RunProgress(
        tmp_path / "m.jsonl", stream=io.StringIO(), teacher_ready=[tmp_path / "teacher0"]
    )
    assert progress.phase() == "loading the teacher"


def test_an_unknown_total_gets_no_eta_until_it_is_set(tmp_path):
    metrics, out, clock = tmp_path / "rank0.jsonl", io.StringIO(), Clock()
    progress = RunProgress(metrics, None, stream=out, every_s=1.0, clock=clock, since=0)
    step(metrics, 1, at=1.0)
    progress.update()
    assert out.getvalue().splitlines()[-1].startswith("[run] training: step 1, elapsed")
    assert "ETA" not in out.getvalue()
    progress.set_total(4, final=True)
    progress.set_total(9)  # a later estimate never replaces the collator's count
    clock.now = 2.0
    progress.update()
    assert "step 1/4 (25%)" in out.getvalue().splitlines()[-1]
    assert "ETA" in out.getvalue().splitlines()[-1]


@pytest.mark.parametrize(
    ("texts", "micro_batch", "grad_accum", "ranks", "epochs", "steps"),
    [(64, 4, 2, 2, 1, 4), (65, 4, 2, 2, 1, 5), (64, 4, 2, 2, 3, 12), (1, 4, 1, 1, 1, 1)],
)
def test_a_run_that_ends_with_its_data_has_a_step_per_global_batch(
    texts, micro_batch, grad_accum, ranks, epochs, steps
):
    assert estimated_steps(texts, micro_batch, grad_accum, ranks, epochs) == steps


def test_the_corpus_is_counted_as_the_collator_reads_it(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    lines = [json.dumps({"text": f"text {i}"}) for i in range(5)] + ["not json"]
    (corpus / "a.jsonl").write_text("\n".join(lines) + "\n")
    (corpus / "b.txt").write_text("one\nparagraph\n\nanother\n\nthird\n")
    assert count_texts(corpus) == 5 + 3  # the bad line skipped, .txt split at blank lines
    assert count_texts(corpus, limit=4) == 4
    assert count_texts(corpus / "a.jsonl", text_field="body") == 0
    assert count_texts(corpus / "b.txt", txt_split="line") == 4  # a text per non-blank line


def test_the_eta_waits_for_two_steps_of_this_launch(tmp_path):
    metrics, out = tmp_path / "rank0.jsonl", io.StringIO()
    step(metrics, 20, at=1000.0)  # the launch before the resume
    progress = RunProgress(metrics, 40, stream=out, every_s=0.0, clock=Clock(), since=5000.0)
    step(metrics, 21, at=5010.0)  # 4010 s later: no rate of 1 step per 4010 s
    progress.update()
    line = out.getvalue().splitlines()[-1]
    assert "step 21/40" in line and "ETA ?" in line  # one step: its time holds the start-up
    step(metrics, 22, at=5014.0)
    progress.update()
    assert "step 22/40" in out.getvalue().splitlines()[-1]
    assert "ETA 01:12" in out.getvalue().splitlines()[-1]  # 18 steps at 4 s


def test_tokens_per_second_is_the_median_of_the_recent_steps(tmp_path):
    metrics, out = tmp_path / "rank0.jsonl", io.StringIO()
    progress = RunProgress(metrics, 10, stream=out, every_s=0.0, clock=Clock(), since=0)
    with open(metrics, "a") as f:  # the first step compiled: a tenth of the rate
        for n, rate in ((1, 80.0), (2, 800.0), (3, 810.0)):
            f.write(json.dumps({"event": "step", "time": n, "step": n, "tokens_per_s": rate}))
            f.write("\n")
    progress.update()
    assert out.getvalue().splitlines()[-1].endswith(", 800 tok/s")
