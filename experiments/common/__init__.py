"""The bottom layer of the harness: configuration machinery and shared utilities.

Nothing here imports ``experiments.rl``, ``experiments.memory`` or ``experiments.launcher``
(``tests/test_layers.py`` checks it): config merging, the ``key=value`` command line, flattening and
hashing (``config.py``, ``cli.py``), the git sha and atomic writes (``provenance.py``).
"""
