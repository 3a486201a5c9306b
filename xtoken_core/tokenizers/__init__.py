"""tokenizers."""
