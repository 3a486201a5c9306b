"""Model presets: named transformers configs built with random weights, the vocab from the caller.

Parameter counts in millions (a tied output layer is the embedding, counted once;
non-embedding: without the embedding and the output layer):

============  =====  ======  ===================  =====  =============  ========  ========  =========
preset        arch   layers  hidden (heads, KV)   tied   non-embedding  V=32,768  V=49,152  V=151,669
============  =====  ======  ===================  =====  =============  ========  ========  =========
tiny          llama  2       64 (4 h, 2 kv)       yes    0.07           2.17      3.22      9.78
student-25m   llama  6       256 (4 h, 4 kv)      yes    6.29           14.68     18.88     45.12
qwen3-0.6b    qwen3  28      1024 (16 h, 8 kv)    yes    440.47         474.02    490.80    595.78
teacher-1.5b  qwen2  28      1536 (12 h, 2 kv)    yes    1310.34        1360.67   1385.84   1543.30
qwen3-1.7b    qwen3  28      2048 (16 h, 8 kv)    yes    1409.41        1476.52   1510.07   1720.03
qwen3-4b      qwen3  36      2560 (32 h, 8 kv)    yes    3633.51        3717.40   3759.34   4021.78
qwen2.5-7b    qwen2  28      3584 (28 h, 4 kv)    no     6525.62        6760.50   6877.94   7612.79
qwen2.5-14b   qwen2  48      5120 (40 h, 8 kv)    no     13212.90       13548.44  13716.21  14765.99
qwen2.5-32b   qwen2  64      5120 (40 h, 8 kv)    no     31206.74       31542.29  31710.06  32759.83
============  =====  ======  ===================  =====  =============  ========  ========  =========

``student-25m`` is ~25 M parameters with a ~75k vocab; with a 150k vocab its embedding alone is
39 M. ``qwen3-0.6b``, ``qwen3-1.7b``, ``qwen3-4b``, ``teacher-1.5b`` (Qwen2-1.5B), ``qwen2.5-7b``,
``qwen2.5-14b`` and ``qwen2.5-32b`` are the shapes of those models (layers, hidden, heads, KV
heads, intermediate size, rope theta, RMS-norm epsilon, tied output layer or not; the Qwen2.5
models carry q/k/v biases); ``test_presets`` checks these counts. The larger ones are teachers
for a tensor-parallel group, whose ranks build their shards on their own devices
(``services/teacher/tensor_parallel.py``): ``load_model`` of one of them allocates it whole.
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


def _qwen2(
    vocab_size: int,
    *,
    hidden: int,
    intermediate: int,
    layers: int,
    heads: int,
    kv_heads: int,
    rms_norm_eps: float,
    tied: bool = False,
):
    """A Qwen2 / Qwen2.5 shape (rope theta 1e6, 32k positions; the output layer untied unless
    ``tied``)."""
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=32_768,
        rope_theta=1_000_000.0,
        rms_norm_eps=rms_norm_eps,
        tie_word_embeddings=tied,
    )


def _qwen2_5_7b(vocab_size: int):
    return _qwen2(vocab_size, hidden=3584, intermediate=18_944, layers=28, heads=28, kv_heads=4,
                  rms_norm_eps=1e-6)  # fmt: skip


def _qwen2_5_14b(vocab_size: int):
    return _qwen2(vocab_size, hidden=5120, intermediate=13_824, layers=48, heads=40, kv_heads=8,
                  rms_norm_eps=1e-5)  # fmt: skip


def _qwen2_5_32b(vocab_size: int):
    return _qwen2(vocab_size, hidden=5120, intermediate=27_648, layers=64, heads=40, kv_heads=8,
                  rms_norm_eps=1e-5)  # fmt: skip


def _qwen3(
    vocab_size: int, *, hidden: int, intermediate: int, layers: int = 28, heads: int = 16
):
    """A Qwen3 shape: heads of 128 (8 KV), tied output layer."""
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40_960,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    )


def _qwen3_1_7b(vocab_size: int):
    return _qwen3(vocab_size, hidden=2048, intermediate=6144)


def _qwen3_4b(vocab_size: int):
    return _qwen3(vocab_size, hidden=2560, intermediate=9728, layers=36, heads=32)


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
    return _qwen3(vocab_size, hidden=1024, intermediate=3072)


def _teacher_1_5b(vocab_size: int):
    return _qwen2(vocab_size, hidden=1536, intermediate=8960, layers=28, heads=12, kv_heads=2,
                  rms_norm_eps=1e-6, tied=True)  # fmt: skip


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset("tiny", "Llama, 2 layers, hidden 64, 4 heads (tests)", _tiny),
        Preset("student-25m", "Llama, 6 layers, hidden 256, 4 heads (~25 M params)", _student_25m),
        Preset("qwen3-0.6b", "Qwen3-0.6B shape: 28 layers, hidden 1024", _qwen3_0_6b),
        Preset("teacher-1.5b", "Qwen2-1.5B shape: 28 layers, hidden 1536", _teacher_1_5b),
        Preset("qwen3-1.7b", "Qwen3-1.7B shape: 28 layers, hidden 2048", _qwen3_1_7b),
        Preset("qwen3-4b", "Qwen3-4B shape: 36 layers, hidden 2560", _qwen3_4b),
        Preset("qwen2.5-7b", "Qwen2.5-7B shape: 28 layers, hidden 3584, untied", _qwen2_5_7b),
        Preset("qwen2.5-14b", "Qwen2.5-14B shape: 48 layers, hidden 5120, untied", _qwen2_5_14b),
        Preset("qwen2.5-32b", "Qwen2.5-32B shape: 64 layers, hidden 5120, untied", _qwen2_5_32b),
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
