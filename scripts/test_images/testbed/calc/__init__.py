"""A tiny arithmetic package: the code under test of the synthetic SWE-bench instance."""

from calc.ops import add, clamp, mean, subtract

__all__ = ["add", "clamp", "mean", "subtract"]
