"""Baselines behind the one method interface; importing this package registers them."""

from baselines.base import METHODS, Method, register_method
from baselines import dense, logra  # noqa: F401  (registers "dense", "logra")

__all__ = ["METHODS", "Method", "register_method"]
