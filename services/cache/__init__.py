"""Building the teacher cache (``xtoken cache build``) and checking a run's caches against its
teachers; the format, reader and checks live in ``xtoken_core/cache``."""
