"""The architecture's rules, checked on the source: the layout (README's
"Layout"), the facts the code cites (docs/facts.md), a repository that
stands alone."""

import ast
import pathlib
import re

REPO = pathlib.Path(__file__).resolve().parent.parent
ENTRY_POINTS = {"models/tasks/run_pretraining.py", "models/tasks/export_bert.py",
                "models/tasks/train_image_classifier.py",
                "input_pipelines/create_pretraining_data.py",
                "input_pipelines/build_image_records.py", "input_pipelines/make_demo_images.py",
                "input_pipelines/make_demo_corpus.py", "input_pipelines/index_records.py",
                # The lever runs' job: run_pretraining's flags, read as it
                # reads them.
                "benchmarks/gpu/lever_worker.py"}


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
    # (tfscale/cli.py registers the entry points' flags for --help; it
    # reads no value.)
    offenders = [str(p.relative_to(REPO))
                 for p in sources("tfscale", "input_pipelines", "models",
                                  "launch", "benchmarks")
                 if re.search(r"\bFLAGS\b", p.read_text())  # not XLA_FLAGS
                 and str(p.relative_to(REPO)) not in ENTRY_POINTS
                 | {"tfscale/cli.py"}]
    assert offenders == []


# What the launchers and the workers agree on: the one engine module
# `launch/` imports, and it imports nothing.
CONTRACT = "tfscale.cluster.contract"


def test_launch_and_planning_never_import_tensorflow():
    for path in sources("launch", "planning"):
        assert not any(m.split(".")[0] in ("tensorflow", "keras")
                       or (m.startswith("tfscale") and m != CONTRACT)
                       for m in imported_modules(path)), path
    # The contract imports nothing heavy: the standard library's
    # subprocess only, inside the one function that runs nvidia-smi.
    contract = REPO / (CONTRACT.replace(".", "/") + ".py")
    assert list(imported_modules(contract)) == ["subprocess"]
    for package in ("tfscale", "tfscale.cluster"):
        init = REPO / (package.replace(".", "/") + "/__init__.py")
        assert not any(m.split(".")[0] in ("tensorflow", "keras")
                       for m in imported_modules(init)), package


def test_the_engine_imports_nothing_from_launch_or_the_jobs():
    for path in sources("tfscale"):
        assert not any(m.split(".")[0] in ("launch",) or
                       m.startswith("models") for m in imported_modules(path)
                       if m != "models"), path


def test_engine_never_imports_models_or_pipelines():
    for path in sources("tfscale"):
        assert not any(m.split(".")[0] in ("models", "input_pipelines")
                       for m in imported_modules(path)), path


def test_models_and_pipelines_do_not_know_each_other():
    # (The jobs, models/tasks, join a model with its records.)
    for path in sources("models"):
        if path.parent.name == "tasks":
            continue
        assert not any(m.startswith("input_pipelines")
                       for m in imported_modules(path)), path
    for path in sources("input_pipelines"):
        assert not any(m.startswith("models") for m in imported_modules(path)), path


# The edge also reads and sets the environment: TensorFlow's log level
# before it loads, and the data service address the launcher sets.
# The modules that read the process environment: the cluster's variables,
# the entry points' edge, and XLA_FLAGS (composed before XLA's first
# compilation).
EDGE = {"tfscale/cluster/environment.py", "tfscale/cli.py",
        "models/tasks/flags.py", "tfscale/xla_flags.py"}


def test_only_the_cluster_module_reads_the_cluster_environment():
    for path in sources("tfscale", "input_pipelines", "models"):
        text = path.read_text()
        if str(path.relative_to(REPO)) not in EDGE:
            assert "os.environ" not in text and "SLURM_PROCID" not in text, path
        if path.name != "environment.py":
            assert "SLURM_PROCID" not in text, path


ROOT_MODULES = {p.stem for p in REPO.glob("*.py") if p.name != "setup.py"}


def module_graph():
    """{module: modules of this repository it imports}, counting imports
    anywhere in a file (function bodies included)."""
    modules = {}
    for folder in ("tfscale", "input_pipelines", "models", "launch",
                   "planning"):
        for path in (REPO / folder).rglob("*.py"):
            parts = path.relative_to(REPO).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path
    for name in ROOT_MODULES:
        modules[name] = REPO / f"{name}.py"
    graph = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                wanted = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                wanted = [f"{node.module}.{a.name}" for a in node.names]
                wanted = [w for w in wanted if w in modules] or [node.module]
            else:
                continue
            for target in wanted:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    targets.add(target)
        graph[name] = targets
    return graph


def circles(graph):
    """The strongly connected groups of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))
    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_circles_even_inside_functions():
    assert circles(module_graph()) == []


def test_the_circle_check_can_fail():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [["a", "b", "c"]]


def test_launch_imports_no_root_module():
    graph = module_graph()
    for name, targets in graph.items():
        if name.startswith("launch"):
            assert not targets & ROOT_MODULES, (name, targets & ROOT_MODULES)


def test_nothing_but_the_packages_is_installed_and_root_files_are_shims():
    """setup.py installs the five packages and console scripts only; the
    checkout's root scripts hold no code of their own."""
    setup = (REPO / "setup.py").read_text()
    assert "py_modules" not in setup and '"benchmarks*"' not in setup
    for name in ROOT_MODULES:
        text = (REPO / f"{name}.py").read_text()
        assert len(text.splitlines()) <= 12, name
        assert f"from models.tasks.{name} import run" in text, name
    # The edge loads TensorFlow only once it has quieted it (in a function).
    top = ast.parse((REPO / "tfscale" / "cli.py").read_text()).body
    loaded = [a.name for node in top if isinstance(node, ast.Import)
              for a in node.names]
    loaded += [node.module for node in top
               if isinstance(node, ast.ImportFrom) and node.module]
    assert not any(m.split(".")[0] in ("tensorflow", "keras", "tfscale")
                   and m not in ("tfscale", CONTRACT) for m in loaded if m), loaded


def tracked_text_files():
    import subprocess
    names = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True,
                           text=True, check=True).stdout.split()
    for name in names:
        path = REPO / name
        if path.suffix in (".py", ".md", ".sh", ".sbatch", ".yaml", ".cfg",
                           ".toml", ".txt", "") and path.is_file():
            try:
                yield name, path.read_text()
            except UnicodeDecodeError:
                continue


def test_the_repository_stands_alone():
    # A clone explains itself: nothing points to files outside it.
    # (The names are split so that this file does not match itself.)
    marks = ("../" + "shared", "DESIGN" + ".md")
    outside = [name for name, text in tracked_text_files()
               if any(mark in text for mark in marks)]
    assert outside == []


# Words about how the project is developed, which mean nothing to a user:
# a tracker's numbers, rounds, machines on loan. The repository names dates,
# versions, commits and commands instead. (Split so that this file does not
# match itself.)
DEVELOPMENT_WORDS = re.compile(
    r"\bissues? #?\d+|\b(?:previous|last|this|next) " + r"round\b"
    + r"|\bwas " + r"lent\b"
    + r"|\b(?:an?|this|earlier|last|previous|that|next) " + r"session\b"
    + r"|\bthis " + r"session's\b", re.IGNORECASE)


def test_no_file_speaks_of_how_the_project_is_developed():
    hits = [f"{name}:{number}: {line.strip()}"
            for name, text in tracked_text_files()
            for number, line in enumerate(text.splitlines(), 1)
            if DEVELOPMENT_WORDS.search(line)]
    assert hits == []
    assert all(DEVELOPMENT_WORDS.search(text) for text in (
        "(issue " + "52)", "Issues " + "48-50", "the previous " + "round's code",
        "no GPU was " + "lent", "in an earlier " + "session"))


def test_every_fact_the_code_cites_is_in_docs_facts():
    import re
    facts = set(re.findall(r"^(\d+)\. ", (REPO / "docs" / "facts.md")
                           .read_text(), flags=re.M))
    cited = set()
    for path in sources("tfscale", "models", "input_pipelines", "launch",
                        "benchmarks", "tests"):
        for match in re.finditer(r"\bfacts? (\d+)(?: and (\d+))?",
                                 path.read_text()):
            cited |= {n for n in match.groups() if n}
    assert cited and cited <= facts, cited - facts


def test_each_flag_is_defined_in_one_place():
    # The jobs' common flags come from models/tasks/flags.py (with each
    # job's defaults), not from a copy per entry point.
    import re
    where = {}
    for path in sources("models", "tfscale", "input_pipelines"):
        for name in re.findall(r"DEFINE_\w+\(\s*\"(\w+)\"", path.read_text()):
            where.setdefault(name, set()).add(str(path.relative_to(REPO)))
    jobs = {"models/tasks/run_pretraining.py",
            "models/tasks/train_image_classifier.py"}
    twice = {name: files for name, files in where.items()
             if len(files & jobs) > 1}
    assert twice == {}


def test_no_engine_function_is_longer_than_a_screen():
    # A loop a reader can follow top to bottom: no function in the engine,
    # the launchers, the pipelines or the jobs over 60 lines of code (its
    # docstring not counted).
    long = []
    for path in sources("tfscale", "launch", "input_pipelines", "models",
                        "planning"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                body = node.body
                first = body[0]
                if (len(body) > 1 and isinstance(first, ast.Expr)
                        and isinstance(first.value, ast.Constant)):
                    first = body[1]
                if node.end_lineno - first.lineno + 1 > 60:
                    long.append(f"{path.relative_to(REPO)}:{node.name}")
    assert long == []


# The engine's layers, bottom to top (docs/architecture.md): a module
# imports from its own unit and the units before it, never one after.
# Package __init__ files (their lazy names) count as their package.
LAYERS = (
    ("tfscale.errors",),
    ("tfscale._compat", "tfscale.lazy", "tfscale.durable",
     "tfscale.precision", "tfscale.xla_flags"),
    ("tfscale.optim",),
    ("tfscale.cluster",),
    ("tfscale.horovod",),
    ("tfscale.noise",),
    ("tfscale.train_config",),
    ("tfscale.step",),
    ("tfscale.keras",),
    ("tfscale.resume",),
    ("tfscale.zero",),
    ("tfscale.trainer",),
    ("tfscale.job_lines",),
    ("tfscale.jobs",),
    ("tfscale.cli",),
)


def layer_of(module):
    """The layer and the unit of a module of tfscale."""
    for height, units in enumerate(LAYERS):
        for unit in units:
            if module == unit or module.startswith(unit + "."):
                return height, unit
    raise AssertionError(f"{module} is in no layer of LAYERS")


def upward_imports(graph):
    """(importer, imported) pairs of tfscale where the import runs up a
    layer, or sideways between two units of one layer."""
    found = []
    for name, targets in graph.items():
        if not name.startswith("tfscale.") or name == "tfscale":
            continue
        height, unit = layer_of(name)
        for target in targets:
            if not target.startswith("tfscale.") or target == "tfscale":
                continue
            if unit == "tfscale.cluster" and target == "tfscale.cluster":
                continue
            other_height, other_unit = layer_of(target)
            if other_height > height or (other_height == height
                                         and other_unit != unit):
                found.append((name, target))
    return sorted(found)


def test_the_engine_imports_only_down_its_layers():
    assert upward_imports(module_graph()) == []


def test_the_layer_check_can_fail():
    graph = {"tfscale.step.plan": {"tfscale.trainer.loop"},
             "tfscale.step.feed": {"tfscale.keras.callbacks"},
             "tfscale.trainer.loop": {"tfscale.step.plan"}}
    assert upward_imports(graph) == [
        ("tfscale.step.feed", "tfscale.keras.callbacks"),
        ("tfscale.step.plan", "tfscale.trainer.loop")]


def test_each_package_says_what_it_owns():
    # Each package of the engine, and the engine itself, opens with a map
    # of its modules (and subpackages).
    for init in [REPO / "tfscale" / "__init__.py",
                 *(REPO / "tfscale").glob("*/__init__.py")]:
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        modules = {p.name for p in init.parent.glob("*.py")
                   if p.name != "__init__.py"}
        if init.parent.name == "horovod":
            modules.add("keras/")
        missing = {m for m in modules if m not in doc}
        assert modules and not missing, (init, missing)


def test_the_step_plan_and_row_need_no_tensorflow():
    # Which steps a call runs, and what its result row holds, are plain
    # Python: readable and testable without TensorFlow.
    # (The row holds the noise scale's numbers, plain Python too.)
    plain = {"tfscale.noise.numbers"}
    for name in ("step/plan", "step/row", "noise/numbers"):
        path = REPO / "tfscale" / f"{name}.py"
        imported = set(imported_modules(path)) - plain
        assert not any(m.split(".")[0] in ("tensorflow", "keras", "numpy",
                                           "tfscale") for m in imported), (
            name, imported)


def test_a_resume_is_read_in_one_place():
    # The checkpoint and the input's saved state are restored, and a
    # positioned input is started, only in tfscale/resume/start.py.
    calls = re.compile(r"\.(restore_latest|restore_input|at)\(")
    found = [str(p.relative_to(REPO)) for p in sources("tfscale")
             if calls.search(p.read_text())]
    assert found == ["tfscale/resume/start.py"]


# Names a newcomer guessed wrong, and what they became: `edge` (the entry
# points' command-line edge) -> `cli`; `launch/run.py` (Horovod's horovodrun
# beside launch/local.py) -> `launch/horovodrun.py`; `fit_inputs` (beside
# input_pipelines/, but it turns model.fit's arguments into a dataset_fn)
# -> `fit_arguments`; `input_feed` (the per-replica batches of one worker's
# iterator) -> `replica_feed`, now `step/feed.py`. The engine's modules
# before its packages are in `tfscale.MOVED` (they import with a warning).
RETIRED = {"tfscale/edge.py": "tfscale/cli.py",
           "launch/run.py": "launch/horovodrun.py",
           "launch/constants.py": "tfscale/cluster/contract.py",
           "tfscale/fit_inputs.py": "tfscale/keras/fit_arguments.py",
           "tfscale/input_feed.py": "tfscale/step/feed.py"}


def retired_modules():
    from tfscale import MOVED
    files = dict(RETIRED)
    for old, new in MOVED.items():
        files[old.replace(".", "/") + ".py"] = new.replace(".", "/") + ".py"
    return files


def test_retired_names_stay_retired():
    files = retired_modules()
    assert len(files) > 30
    for old, new in files.items():
        assert not (REPO / old).exists() and (REPO / new).exists(), old
    names = re.compile("|".join(
        rf"(?<![\w.]){re.escape(old[:-3].replace('/', '.'))}(?![\w])"
        rf"|(?<![\w./]){re.escape(old)}" for old in files))
    stale = [f"{name}: {names.search(text).group(0)}"
             for name, text in tracked_text_files()
             if name not in ("tests/test_layout.py", "tfscale/__init__.py")
             and names.search(text)]
    assert stale == []


def test_a_moved_module_imports_with_a_warning():
    import subprocess
    import sys
    code = ("import warnings; warnings.simplefilter('error')\n"
            "try:\n    from tfscale import strategies\n"
            "except DeprecationWarning as e:\n    print(e)\n"
            "warnings.simplefilter('ignore')\n"
            "from tfscale import strategies\n"
            "import tfscale.cluster.strategies as new\n"
            "print(strategies is new)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, text=True,
                         capture_output=True, check=True).stdout.split("\n")
    assert out[:2] == ["tfscale.strategies is now tfscale.cluster.strategies",
                       "True"]


# Names that read as something else, and what they became on 2026-11-26:
# the jobs' interval callback beside the Trainer's `IntervalReport`; the
# class that starts every fit, fresh ones too; a step variable and a step
# count under one name; two "feeds" of different types.
RENAMED = {r"\bIntervalLog\b": "IntervalHistory",
           r"\bclass Resume\b|\.Resume\(": "FitStart",
           r"position\.steps\b": "position.steps_taken",
           r"position\.step\b": "position.step_variable",
           r"TrainStep\([^)]*\bfeed=": "TrainStep(take_batches=...)",
           r"trainer\._feed\b": "trainer._replica_feed"}


def test_renamed_names_stay_renamed():
    code = [(str(p.relative_to(REPO)), p.read_text())
            for p in sources("tfscale", "models", "benchmarks", "tests")
            if p.name != "test_layout.py"]
    stale = [f"{name}: {new}" for old, new in RENAMED.items()
             for name, text in code if re.search(old, text, re.S)]
    assert stale == []
