"""Names a package exports without importing their modules until first
use, so that importing the package loads no TensorFlow."""

import importlib
from typing import Callable, Dict


def exports(package: str, names: Dict[str, str]) -> Callable[[str], object]:
    """A module `__getattr__` for `package`: each of `names` (name ->
    module) is imported from its module on first use."""
    def __getattr__(name):
        if name not in names:
            raise AttributeError(
                f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(names[name]), name)
    return __getattr__
