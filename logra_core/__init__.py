"""LoGRA's method: gradient-sketch optimizer, predicted-KL step control, low-rank sync.

This package imports nothing from the harness (``experiments``, ``baselines``), so it can be
dropped into any PyTorch training loop.
"""
