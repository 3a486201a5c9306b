"""model_vocab_size and check_vocab: padded output layers pass, smaller models never do."""

import pytest

from xtoken_core.models import check_vocab, load_model, model_vocab_size, preset_vocab_size


def test_model_vocab_size_is_the_output_layer_width():
    assert model_vocab_size(load_model("tiny", vocab_size=777)) == 777


def test_a_padded_output_layer_is_accepted():
    check_vocab("teacher", 151_936, 151_669)
    check_vocab("teacher", 151_936, 151_669, projection_vocab=151_936)
    check_vocab("student", 32_768, 32_768, projection_vocab=32_000)


def test_a_model_smaller_than_its_tokenizer_names_both_sizes_and_the_fix():
    with pytest.raises(ValueError) as info:
        check_vocab("student", 32_000, 32_768)
    message = str(info.value)
    assert "student" in message and "32000" in message and "32768" in message
    assert "vocab_size=32768" in message


def test_a_projection_past_the_models_logits_is_refused():
    with pytest.raises(ValueError, match="projection matrix addresses 151936 ids.*49152 logits"):
        check_vocab("teacher", 49_152, 49_152, projection_vocab=151_936)


@pytest.mark.parametrize(
    "args", [(0, 10, None), (10, -1, None), (10, 10, 0), (10.0, 10, None), (True, 1, None)]
)
def test_sizes_must_be_positive_ints(args):
    with pytest.raises(ValueError, match="must be a positive int"):
        check_vocab("x", *args)


@pytest.mark.parametrize(
    ("tokenizer_vocab", "rows"), [(151669, 151680), (49152, 49152), (1, 128), (129, 256)]
)
def test_a_preset_output_layer_is_rounded_up_to_a_multiple_of_128(tokenizer_vocab, rows):
    assert preset_vocab_size(tokenizer_vocab) == rows


def test_a_preset_student_is_padded_and_any_other_model_keeps_the_tokenizers_size():
    from xtoken_core.models.loading import student_vocab_size

    assert student_vocab_size("qwen3-1.7b", 151669) == 151680
    assert student_vocab_size("student-25m:drop=1", 151669) == 151680
    assert student_vocab_size("smollm2:drop=10-19", 49152) == 49152
    assert student_vocab_size("/models/qwen3", 151669) == 151669
    assert student_vocab_size("gguf:/m/x.gguf", 151669) == 151669


def test_a_preset_vocab_must_be_a_positive_int():
    with pytest.raises(ValueError, match="tokenizer_vocab must be a positive int"):
        preset_vocab_size(0)
