"""Tables and figures from run directories under a results root.

``python -m analysis <root>`` writes them all (``report.py``); ``load.py`` turns the run
directories into one DataFrame; ``memory``, ``accuracy``, ``sync``, ``kl`` and ``learning`` each
build their own table or figure from it; ``render.py`` holds what they share. ``summary``,
``curves`` and ``traces`` are per-run-directory tools used by the earlier result folders.
"""
