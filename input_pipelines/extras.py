"""Modules of tfscale's optional extras, imported with the fix in the error:
`pip install "tfscale[EXTRA]"` (setup.py's extras_require; README,
Install)."""

import importlib


def require(module: str, extra: str):
    """`module`, imported; an ImportError naming `extra` when it is not
    installed."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(
            f"{module} is not installed; it comes with tfscale's [{extra}] "
            f"extra: pip install \".[{extra}]\" in the checkout") from e
