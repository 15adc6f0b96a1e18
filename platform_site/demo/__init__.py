"""The demo the platform sets up on a fresh install (``manage.py bootstrap_demo``): models it
trains itself, since no model hub is reachable (``fraud``: a tabular classifier; ``storyteller``:
a byte-level text generator)."""
