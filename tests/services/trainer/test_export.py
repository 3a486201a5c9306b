"""The trained student's export is a Hugging Face folder that transformers uses alone, offline:
its tokenizer (the run's ids), generation defaults, weights and a model card of the run."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from services.trainer.model_card import card_facts, render_card, write_model_card
from services.trainer.trainer import build_step
from tests.services.trainer import distill_setup as setup
from xtoken_core.tokenizers import load_tokenizer


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A tiny student trained 3 CE steps, evaluated before and after, exported with its card as
    the trainer shell does it; ``xtoken run``'s run.json and a teacher eval record beside it."""
    run_dir = tmp_path_factory.mktemp("run")
    (run_dir / "config").mkdir()
    run = {"data": {"train": "/data/train.jsonl", "heldout": "/data/heldout.jsonl"},
           "teacher": {"model": "tiny"}}  # fmt: skip
    (run_dir / "config" / "run.json").write_text(json.dumps(run))
    (run_dir / "metrics").mkdir()
    teacher_eval = {"event": "eval", "bits_per_byte": 3.25, "who": "teacher"}
    (run_dir / "metrics" / "teacher.group0.jsonl").write_text(json.dumps(teacher_eval) + "\n")
    config = setup.trainer_config(None, schedule={"max_steps": 3}, run_dir=str(run_dir))
    step = build_step(config)
    student = step.student
    summary = {"student_before": student.evaluate(setup.TEXTS, config.eval.ctx)}
    batch = setup.micro_batches()[0]
    for _ in range(3):
        step.run([setup.micro_batch(batch, ["a", "b"], with_teacher=False)])
    summary["student_after"] = student.evaluate(setup.TEXTS, config.eval.ctx)
    student.export(run_dir / "final")
    facts = card_facts(config, run_dir, summary, step=student.step, world_size=1)
    write_model_card(run_dir / "final", facts)
    return run_dir / "final", summary


def test_transformers_alone_loads_the_folder_and_generates(exported):
    final, _ = exported
    tokenizer = AutoTokenizer.from_pretrained(final, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(final, local_files_only=True).eval()
    prompt = tokenizer("The quick brown fox", return_tensors="pt")
    out = model.generate(**prompt, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    n = prompt["input_ids"].shape[1]
    assert out.shape == (1, n + 4)
    assert torch.equal(out[0, :n], prompt["input_ids"][0])
    assert isinstance(tokenizer.decode(out[0, n:]), str)


def test_the_exported_tokenizer_gives_the_runs_ids(exported):
    final, _ = exported
    tokenizer = AutoTokenizer.from_pretrained(final, local_files_only=True)
    run_tokenizer = load_tokenizer(setup.STUDENT_TOKENIZER)
    for text in setup.TEXTS:
        assert tokenizer(text)["input_ids"] == run_tokenizer.encode(text).ids.tolist(), text


def test_generation_defaults_are_the_tokenizers_special_ids(exported):
    final, _ = exported
    tok = load_tokenizer(setup.STUDENT_TOKENIZER)
    generation = GenerationConfig.from_pretrained(final, local_files_only=True)
    assert (generation.bos_token_id, generation.eos_token_id) == (tok.bos_id, tok.eos_id)
    assert generation.pad_token_id == (tok.pad_id if tok.pad_id is not None else tok.eos_id)
    config = json.loads((final / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (tok.bos_id, tok.eos_id)
    # no pad id in config.json: it would freeze that embedding row when the folder trains again
    model = AutoModelForCausalLM.from_pretrained(final, local_files_only=True)
    assert model.get_input_embeddings().padding_idx is None


def test_the_model_card_names_the_run(exported):
    final, summary = exported
    card = (final / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: transformers\n")
    assert f"| student | `tiny`, tokenizer `{setup.STUDENT_TOKENIZER}` |" in card
    assert "| teacher | none |" in card  # a CE run learns from no teacher
    assert "| loss | student cross-entropy only (no teacher) |" in card
    assert "| training data | `/data/train.jsonl` |" in card
    assert "| held-out data | `/data/heldout.jsonl` |" in card
    assert "| steps | 3 (global batch 2 texts, lr 0.003) |" in card
    before = summary["student_before"]["bits_per_byte"]
    after = summary["student_after"]["bits_per_byte"]
    assert f"| student before | {before:.4f} |" in card
    assert f"| student after | {after:.4f} |" in card
    assert "| teacher | 3.2500 |" not in card  # a CE run has no teacher to compare with


def test_a_kd_card_shows_the_loss_and_the_teachers_bits_per_byte():
    facts = {
        "name": "my-kd", "student": "qwen3-0.6b", "student_tokenizer": "qwen3",
        "teacher": "/models/t", "teacher_tokenizer": "llama3", "loss_mode": "xtoken",
        "temperature": 2.0, "kl_weight": 0.3, "ce_weight": 1.0, "train_data": None,
        "heldout_data": None, "steps": 500, "global_batch": 32, "lr": 3e-4, "teacher_bpb": 0.9,
        "student_before_bpb": None, "student_after_bpb": 1.1,
    }  # fmt: skip
    card = render_card(facts)
    assert "| teacher | `/models/t`, tokenizer `llama3` |" in card
    assert "| loss | relaxed gold (xtoken), temperature 2, kl_weight 0.3, ce_weight 1 |" in card
    assert "| training data | unknown |" in card
    assert "| teacher | 0.9000 |" in card and "| student after | 1.1000 |" in card
    assert "student before" not in card  # unknown values are left out, never made up


def test_a_card_of_several_teachers_names_each_with_its_tokenizer_and_weight():
    facts = {
        "name": "two", "student": "qwen3-0.6b", "student_tokenizer": "qwen3",
        "teacher": "/models/t", "teacher_tokenizer": "llama3", "teacher_weight": 0.5,
        "extra_teachers": [{"model": "gemma3-270m", "tokenizer": "gemma3", "weight": 0.5}],
        "loss_mode": "pkl", "temperature": 1.0, "kl_weight": 1.0, "ce_weight": 1.0,
        "train_data": None, "heldout_data": None, "steps": 5, "global_batch": 8, "lr": 1e-3,
        "teacher_bpb": None, "student_before_bpb": None, "student_after_bpb": None,
    }  # fmt: skip
    card = render_card(facts)
    assert "| teacher | `/models/t`, tokenizer `llama3`, weight 0.5 |" in card
    assert "| teacher 1 | `gemma3-270m`, tokenizer `gemma3`, weight 0.5 |" in card
