"""Data plane helpers: the jagged <-> padded codec (``xtoken_core.data_plane.codec``)."""
