"""Data: the cross-tokenizer collator, the sample schema, corpora and projection matrices."""

from xtoken_core.data.collator import CrossTokenizerCollator, resolve_pad_id
from xtoken_core.data.corpus import (
    DemoCorpus,
    build_demo_corpus,
    chunk_text,
    default_demo_dir,
    iter_texts,
)
from xtoken_core.data.sample import (
    SAMPLE_FIELDS,
    FieldSpec,
    pad_samples,
    pad_values,
    validate_sample,
)

__all__ = [
    "SAMPLE_FIELDS",
    "CrossTokenizerCollator",
    "DemoCorpus",
    "FieldSpec",
    "build_demo_corpus",
    "chunk_text",
    "default_demo_dir",
    "iter_texts",
    "pad_samples",
    "pad_values",
    "resolve_pad_id",
    "validate_sample",
]

# Other modules of this package append their exports below.
