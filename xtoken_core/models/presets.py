"""Model presets: named transformers configs built with random weights, the vocab from the caller.

Parameter counts in millions (embeddings tied to the output layer, so counted once):

============  =====  ======  ===========  =============  ========  ========  =========
preset        arch   layers  hidden       non-embedding  V=32,768  V=49,152  V=151,669
============  =====  ======  ===========  =============  ========  ========  =========
tiny          llama  2       64 (4 h)     0.07           2.17      3.22      9.78
student-25m   llama  6       256 (4 h)    6.29           14.68     18.88     45.12
qwen3-0.6b    qwen3  28      1024 (16 h)  440.47         474.02    490.80    595.78
teacher-1.5b  qwen2  28      1536 (12 h)  1310.34        1360.67   1385.84   1543.30
============  =====  ======  ===========  =============  ========  ========  =========

``student-25m`` is ~25 M parameters with a ~75k vocab; with a 150k vocab its embedding alone is
39 M. ``qwen3-0.6b`` is the Qwen3-0.6B shape and ``teacher-1.5b`` the Qwen2-1.5B shape
(``test_presets`` checks these counts).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Preset:
    """A named model shape.

    Attributes:
        name: the preset name (``load_model(name, vocab_size=...)``).
        description: one line: architecture and size.
        make_config: vocab_size -> a transformers ``PretrainedConfig``.
    """

    name: str
    description: str
    make_config: Callable[[int], object]

    def config(self, vocab_size: int):
        """The transformers config of this preset for a vocabulary.

        Args:
            vocab_size: rows of the embedding and the output layer (> 0).

        Returns:
            A ``PretrainedConfig`` (Llama / Qwen2 / Qwen3).

        Raises:
            ValueError: ``vocab_size`` is not a positive int.
        """
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size <= 0:
            raise ValueError(
                f"preset {self.name!r} needs vocab_size as a positive int, got {vocab_size!r}; "
                "pass the tokenizer's vocab_size"
            )
        return self.make_config(vocab_size)


def _tiny(vocab_size: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    )


def _student_25m(vocab_size: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=4096,
        rope_theta=10_000.0,
        tie_word_embeddings=True,
    )


def _qwen3_0_6b(vocab_size: int):
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40_960,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    )


def _teacher_1_5b(vocab_size: int):
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        max_position_embeddings=32_768,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    )


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset("tiny", "Llama, 2 layers, hidden 64, 4 heads (tests)", _tiny),
        Preset("student-25m", "Llama, 6 layers, hidden 256, 4 heads (~25 M params)", _student_25m),
        Preset("qwen3-0.6b", "Qwen3-0.6B shape: 28 layers, hidden 1024", _qwen3_0_6b),
        Preset("teacher-1.5b", "Qwen2-1.5B shape: 28 layers, hidden 1536", _teacher_1_5b),
    )
}


def get_preset(name: str) -> Preset:
    """The preset of that name.

    Args:
        name: one of ``PRESETS``.

    Returns:
        The Preset.

    Raises:
        ValueError: unknown name (lists the presets).
    """
    preset = PRESETS.get(name)
    if preset is None:
        raise ValueError(
            f"unknown model preset {name!r}; use one of {sorted(PRESETS)}, 'smollm2', a GGUF "
            "preset, gguf:PATH, or a local Hugging Face model directory"
        )
    return preset
