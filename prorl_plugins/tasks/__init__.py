"""The built-in task handlers: `shell`, `python_math`, `arithmetic`, `swe`, `harbor` and `relay`. Registered through the
`prorl_adapter` entry point `builtin_tasks`, exactly as a third-party plugin would register its own."""

from prorl_adapter.hooks import hookimpl

from .arithmetic import ArithmeticTask
from .harbor import HarborTask
from .python_math import PythonMathTask
from .relay import RelayTask
from .shell import ShellTask
from .swe import SweTask


@hookimpl
def prorl_register_tasks():
    return [ShellTask(), PythonMathTask(), SweTask(), HarborTask(), RelayTask(), ArithmeticTask()]
