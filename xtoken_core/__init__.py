"""xtoken_core."""
