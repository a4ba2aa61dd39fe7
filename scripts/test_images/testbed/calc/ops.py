"""Arithmetic helpers."""


def add(a, b):
    """Return the sum of a and b."""
    return a + b


def subtract(a, b):
    """Return a minus b."""
    return a - b


def mean(values):
    """Return the arithmetic mean of a non-empty sequence of numbers."""
    if not values:
        raise ValueError("mean() of an empty sequence")
    return sum(values) / len(values)


def clamp(value, low, high):
    """Return value limited to the closed interval [low, high]."""
    return max(low, min(value, low))
