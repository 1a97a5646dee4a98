"""Modules of tfscale's optional extras, imported with the fix in the error:
`pip install ".[EXTRA]"` in the checkout (setup.py's extras_require;
README, Install). The entry points print a `MissingExtra` as its one line
(`tfscale.cli`), with no traceback."""

import importlib

from tfscale.errors import MissingExtra


def require(module: str, extra: str):
    """`module`, imported; a `MissingExtra` naming `extra` when it is not
    installed."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise MissingExtra(
            f"{module} is not installed; it comes with tfscale's [{extra}] "
            f"extra: pip install \".[{extra}]\" in the checkout "
            f"({type(e).__name__}: {e})") from None
