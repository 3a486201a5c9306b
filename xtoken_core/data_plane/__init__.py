"""data_plane."""
