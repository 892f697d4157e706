"""Baselines behind the one method interface; importing this package registers them."""

from baselines.base import METHODS, Method, register_method
from baselines import dense, galore, logra, lora  # noqa: F401  (registers every method)

__all__ = ["METHODS", "Method", "register_method"]
