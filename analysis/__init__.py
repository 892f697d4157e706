"""Tables and figures from run directories under a results root.

``python -m analysis <root>`` writes them all (``report.py``); ``load.py`` turns the run
directories into one DataFrame; ``memory``, ``accuracy``, ``intervals`` (accuracy with bootstrap
intervals, ``bootstrap.py``; paired by problem from ``outcomes.py``), ``lr_sweep``, ``tradeoff`` (memory vs accuracy), ``claims``, ``sync``,
``kl`` and ``learning`` each build their own table or figure from it; ``render.py`` holds what they
share, ``cli.py`` the command line of the tools that take a root. ``summary``,
``curves`` and ``traces`` are per-run-directory tools used by the earlier result folders.
"""
