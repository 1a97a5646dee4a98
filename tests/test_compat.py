"""Private TensorFlow and Keras names live in tfscale/_compat.py and
tfscale/keras/callbacks.py only, and each shim there says, once, when it
runs on versions it was not checked with."""

import ast
import io
import logging
import pathlib
import re
import tokenize

import pytest

from tfscale import _compat
from tfscale.keras import callbacks as _compat_callbacks

REPO = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("tfscale", "input_pipelines", "models", "launch")

# Private members of TensorFlow's and Keras's classes that tfscale needs; a
# subclass could reach them through `self`, which the general rule below
# cannot tell from its own attributes.
KNOWN_PRIVATE = ("_get_variable_index", "_all_reduce_sum_gradients",
                 "_symbolic_build", "_compile_metrics", "_initial_epoch",
                 "_global_train_batch", "_writers", "_numpy",
                 "_communication_options", "_weights_path",
                 "_training_metadata_path",
                 "_distribute_strategy")


# tfscale's own private modules.
OWN_PRIVATE = ("_compat", "_compat_callbacks", "_state", "_unsupported")
COMPAT = ("tfscale/_compat.py", "tfscale/keras/callbacks.py")


def code_only(text: str) -> list:
    """The lines of `text` with strings and comments blanked out."""
    lines = [list(line) for line in text.splitlines()]
    tokens = tokenize.generate_tokens(io.StringIO(text).readline)
    for token in tokens:
        if token.type not in (tokenize.STRING, tokenize.COMMENT):
            continue
        (row, col), (end_row, end_col) = token.start, token.end
        for r in range(row, end_row + 1):
            line = lines[r - 1]
            first = col if r == row else 0
            last = end_col if r == end_row else len(line)
            line[first:last] = " " * (last - first)
    return ["".join(line) for line in lines]


def private_uses(text: str) -> list:
    """(line number, line) of code that reaches a private name of another
    object, or a private module of TensorFlow or Keras."""
    found = []
    for number, code in enumerate(code_only(text), 1):
        if re.search(r"\btensorflow\.python\b|\bkeras\.src\b", code):
            found.append((number, code.strip()))
            continue
        for owner, name in re.findall(
                r"(?<![\w.])([A-Za-z_]\w*)\.(_[a-z]\w*)", code):
            if name in KNOWN_PRIVATE:
                found.append((number, code.strip()))
            elif owner in ("self", "cls", "os") or name in OWN_PRIVATE \
                    or name.startswith("_tfscale"):
                continue
            else:
                found.append((number, code.strip()))
    return found


def test_private_names_only_in_compat():
    offenders = [f"{path.relative_to(REPO)}:{number}: {line}"
                 for package in PACKAGES
                 for path in sorted((REPO / package).rglob("*.py"))
                 if str(path.relative_to(REPO)) not in COMPAT
                 for number, line in private_uses(path.read_text())]
    assert offenders == []


def test_the_rule_catches_what_it_is_for():
    # Negative controls: each would be a private use outside _compat.
    for line in ("view = tensor._numpy()",
                 "index = self._get_variable_index(variable)",
                 "from keras.src.backend.tensorflow import trainer",
                 "model._initial_epoch = None",
                 "ctx = tensorflow.python.eager.context"):
        assert private_uses(line), line
    for line in ("self._progress = 0", "os._exit(1)", "_compat.shim(f)",
                 "optimizer._tfscale_reduces_first = True"):
        assert not private_uses(line), line


def test_every_shim_is_gated_on_the_versions_it_was_checked_with():
    shims = []
    for module in (_compat, _compat_callbacks):
        tree = ast.parse(pathlib.Path(module.__file__).read_text())
        shims += [(module, node.name) for node in tree.body
                  if isinstance(node, ast.FunctionDef)
                  and node.name not in ("unverified", "shim")]
    assert len(shims) >= 25
    for module, name in shims:
        assert getattr(module, name).checked_with == _compat.CHECKED_WITH, \
            name


def test_an_unchecked_version_is_named_once_per_shim(monkeypatch, caplog):
    assert _compat.unverified({"TensorFlow": (2, 21), "Keras": (3, 15)}) == ""
    assert _compat.unverified({"TensorFlow": (2, 22), "Keras": (3, 15)}) == \
        "TensorFlow 2.22"
    monkeypatch.setattr(_compat, "_UNVERIFIED", "Keras 3.99")
    monkeypatch.setattr(_compat, "_warned", set())
    caplog.set_level(logging.WARNING)
    _compat_callbacks.tensorboard_writers(object())
    _compat_callbacks.tensorboard_writers(object())
    _compat.in_xla_context()
    said = [r.getMessage() for r in caplog.records
            if "checked with TensorFlow 2.21 and Keras 3.15" in
            r.getMessage()]
    assert len(said) == 2, said
    assert "keras.callbacks.tensorboard_writers" in said[0]
    assert "this is Keras 3.99" in said[0]


def test_a_missing_private_name_is_named():
    class NotABackup:
        backup_dir = "x"
    with pytest.raises(RuntimeError, match="BackupAndRestore._weights_path"):
        _compat_callbacks.redirect_backup(NotABackup(), "/tmp/b")
