"""Sweeps: expand a sweep YAML into runs keyed by config hash, and launch them (debug, local, slurm).

``sweep.py`` (the plan: grid × ablations → runs, hashes, run dirs), ``jobs.py`` (the job function:
one run, ``done.json``, requeue on preemption), ``executors.py`` (debug / local / slurm), and the
entry point ``python -m experiments.launch``.
"""
