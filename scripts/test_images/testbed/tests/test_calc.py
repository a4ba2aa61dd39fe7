import pytest
from calc import add, mean, subtract


def test_add():
    assert add(2, 3) == 5


def test_subtract():
    assert subtract(2, 3) == -1


def test_mean():
    assert mean([1, 2, 3, 4]) == 2.5


def test_mean_of_nothing():
    with pytest.raises(ValueError):
        mean([])
