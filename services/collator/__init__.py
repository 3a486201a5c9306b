"""collator."""
