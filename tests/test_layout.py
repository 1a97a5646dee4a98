"""The architecture's rules (DESIGN.md, STYLE.md), checked on the source."""

import ast
import pathlib

REPO = pathlib.Path(__file__).resolve().parent.parent
ENTRY_POINTS = {"run_pretraining.py", "export_bert.py", "train_image_classifier.py",
                "input_pipelines/create_pretraining_data.py",
                "input_pipelines/build_image_records.py", "input_pipelines/make_demo_images.py",
                "input_pipelines/make_demo_corpus.py", "input_pipelines/index_records.py"}


def sources(*folders):
    for folder in folders:
        yield from (REPO / folder).rglob("*.py")


def imported_modules(path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield node.module


def test_flags_are_read_only_by_entry_points():
    offenders = [str(p.relative_to(REPO))
                 for p in sources("tfscale", "input_pipelines", "models",
                                  "launch", "benchmarks")
                 if "FLAGS" in p.read_text()
                 and str(p.relative_to(REPO)) not in ENTRY_POINTS]
    assert offenders == []


def test_launch_never_imports_tensorflow():
    for path in sources("launch"):
        assert not any(m.split(".")[0] in ("tensorflow", "keras", "tfscale")
                       for m in imported_modules(path)), path


def test_engine_never_imports_models_or_pipelines():
    for path in sources("tfscale"):
        assert not any(m.split(".")[0] in ("models", "input_pipelines")
                       for m in imported_modules(path)), path


def test_models_and_pipelines_do_not_know_each_other():
    for path in sources("models"):
        assert not any(m.startswith("input_pipelines")
                       for m in imported_modules(path)), path
    for path in sources("input_pipelines"):
        assert not any(m.startswith("models") for m in imported_modules(path)), path


def test_only_the_cluster_module_reads_the_cluster_environment():
    for path in sources("tfscale", "input_pipelines", "models"):
        text = path.read_text()
        if path.name != "cluster.py":
            assert "os.environ" not in text and "SLURM_PROCID" not in text, path
