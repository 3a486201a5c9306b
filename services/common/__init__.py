"""Shared process plumbing of every service: typed configs and the one process lifecycle."""
