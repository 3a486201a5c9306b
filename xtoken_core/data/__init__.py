"""Data: the cross-tokenizer collator, the sample schema, document packing, corpora and projection
matrices."""

from xtoken_core.data.collator import CrossTokenizerCollator, resolve_pad_id
from xtoken_core.data.corpus import (
    DemoCorpus,
    build_demo_corpus,
    chunk_text,
    corpus_key_prefix,
    default_demo_dir,
    iter_texts,
)
from xtoken_core.data.sample import (
    SAMPLE_FIELDS,
    FieldSpec,
    field_names,
    num_teachers_of,
    pad_samples,
    pad_values,
    sample_fields,
    teacher_field_name,
    validate_sample,
)

__all__ = [
    "SAMPLE_FIELDS",
    "CrossTokenizerCollator",
    "DemoCorpus",
    "FieldSpec",
    "build_demo_corpus",
    "chunk_text",
    "corpus_key_prefix",
    "default_demo_dir",
    "field_names",
    "iter_texts",
    "num_teachers_of",
    "pad_samples",
    "pad_values",
    "resolve_pad_id",
    "sample_fields",
    "teacher_field_name",
    "validate_sample",
]

# Other modules of this package append their exports below.

from xtoken_core.data.projection import (  # noqa: E402
    Projection,
    build_exact_token_map,
    clear_projection_caches,
    exact_token_map_from_topk,
    get_sparse_projection_matrix,
    get_topk_projection,
    open_projection,
    parse_projection_file,
)
from xtoken_core.data.projection_build import (  # noqa: E402
    build_projection,
    build_projection_with_stats,
    projection_stats,
)

__all__ += [
    "Projection",
    "build_exact_token_map",
    "build_projection",
    "build_projection_with_stats",
    "clear_projection_caches",
    "exact_token_map_from_topk",
    "get_sparse_projection_matrix",
    "get_topk_projection",
    "open_projection",
    "parse_projection_file",
    "projection_stats",
]
