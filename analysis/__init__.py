"""Tables and figures from run directories under a results root.

``python -m analysis <root>`` writes them all (``report.py``); ``load.py`` turns the run
directories into one DataFrame; ``memory``, ``accuracy``, ``intervals`` (accuracy with intervals over
seeds × problems, ``crossed.py``, t quantiles in ``tdist.py``; paired by problem from ``outcomes.py``),
``lr_sweep``, ``tradeoff`` (memory vs accuracy), ``claims``, ``sync``, ``kl``, ``control``, ``seeds`` (the
fresh-seed study's looks) and ``learning`` each build their own table or figure from it; ``render.py``
holds what they share, ``names.py`` the variants' readable names, ``provenance.py`` how shas are shown,
``cli.py`` the command line of the tools that take a root. ``coverage.py`` (with ``outcome_model.py``,
``coverage_table.py``; ``bootstrap.py`` is one of its candidates) measures the intervals' coverage by
simulation; ``readme.py`` (rows in ``readme_rows.py``, ``readme_runs.py``) writes README's headline table.
``summary``, ``curves`` and ``traces`` are per-run-directory tools used by the earlier result folders.
"""

