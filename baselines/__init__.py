"""Baselines behind the one method interface; importing this package registers them."""

from baselines.base import METHODS, Method, register_method
from baselines import dense  # noqa: F401  (registers "dense")

__all__ = ["METHODS", "Method", "register_method"]
