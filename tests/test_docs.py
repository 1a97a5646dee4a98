"""The README and docs/ say what exists: every relative link resolves (its
file, and its #anchor in a markdown file), and every command-line flag the
front page names (and every snake_case flag a docs page names: tfscale's
style; other tools' flags are kebab-case) is defined somewhere in the
project."""

import pathlib
import re

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", REPO / "benchmarks" / "README.md",
         *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FLAG = re.compile(r"(?<![\w-])--([a-z][a-z0-9]*(?:[_-][a-z0-9]+)*)")


def anchors(path: pathlib.Path) -> set:
    """GitHub's heading anchors of a markdown file."""
    found = set()
    for line in path.read_text().splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            slug = re.sub(r"[^\w\- ]", "", title).replace(" ", "-")
            found.add(slug)
    return found


def project_flags() -> set:
    """Flags defined by absl (DEFINE_*, aliases) or argparse anywhere in the
    project's packages."""
    flags = set()
    for folder in ("tfscale", "input_pipelines", "models", "launch",
                   "planning", "benchmarks"):
        for path in (REPO / folder).rglob("*.py"):
            text = path.read_text()
            flags |= set(re.findall(r"DEFINE_\w+\(\s*\"(\w+)\"", text))
            flags |= set(re.findall(r"DEFINE_alias\(\s*\"(\w+)\"", text))
            flags |= set(re.findall(r"add_argument\(\s*(?:\"-\w+\",\s*)?"
                                    r"\"--([\w-]+)\"", text))
            # Flags a loop defines from a table of names.
            flags |= set(re.findall(r"\(\"(\w+)\",\s*\"", text))
    # The jobs' common flags (models/tasks/flags.py's table).
    from models.tasks.flags import JOB_FLAG_TABLE
    flags |= {name for _, _, name, _, _ in JOB_FLAG_TABLE}
    # absl's own, and other tools' snake_case flags the pages name.
    return flags | {"help", "helpfull", "helpshort", "flagfile", "verbosity",
                    "noprogress", "noverify", "nodo_train", "bind_all",
                    # XLA's own (XLA_FLAGS).
                    "xla_gpu_autotune_level", "xla_gpu_enable_triton_gemm",
                    "xla_gpu_per_fusion_autotune_cache_dir",
                    "xla_gpu_enable_cublaslt", "xla_gpu_dot_merger_threshold_mb",
                    "xla_gpu_enable_command_buffer",
                    "xla_gpu_fused_attention_use_cudnn_rng",
                    "xla_gpu_enable_cudnn_fmha",
                    "xla_enable_command_buffers_during_profiling",
                    "xla_gpu_enable_scatter_determinism_expander"}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(page):
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"(https?|mailto):", target):
            continue
        file, _, anchor = target.partition("#")
        path = (page.parent / file).resolve() if file else page
        if not path.exists():
            broken.append(target)
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            broken.append(target)
    assert broken == []


def test_every_flag_the_pages_name_exists():
    known = project_flags()
    missing = {}
    for page in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for flag in FLAG.findall(page.read_text()):
            if page.name != "README.md" and "_" not in flag:
                continue  # other tools' flags (mpirun, srun, pip, dask)
            if flag not in known:
                missing.setdefault(page.name, set()).add(flag)
    assert missing == {}


def test_the_checks_can_fail(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Title here\n[a](missing.md) [b](#title-here) "
                    "[c](#nowhere)\n")
    broken = [t for t in LINK.findall(page.read_text())
              if not (page.parent / t.partition("#")[0]).exists()
              or (t.startswith("#") and t[1:] not in anchors(page))]
    assert broken == ["missing.md", "#nowhere"]
    assert "no_such_flag" not in project_flags()
    assert "num_workers" in project_flags()


DATED = re.compile(r"\b20\d\d-\d\d-\d\d\b")


def test_measurements_with_dates_live_in_benchmarks_readme():
    # README and docs/ say what holds and how to use it; the dated figures
    # (with their commands) are benchmarks/README.md's.
    dated = [f"{page.relative_to(REPO)}:{n}: {line.strip()}"
             for page in [REPO / "README.md", *sorted((REPO / "docs").glob(
                 "*.md"))]
             for n, line in enumerate(page.read_text().splitlines(), 1)
             if DATED.search(line)]
    assert dated == []
    assert DATED.search((REPO / "benchmarks" / "README.md").read_text())


def test_the_benchmarks_page_is_a_reference_of_current_results():
    """benchmarks/README.md holds the current results, by concern, within
    600 lines; older figures live in history.md behind links."""
    page = (REPO / "benchmarks" / "README.md").read_text()
    assert len(page.splitlines()) <= 600
    concerns = re.findall(r"(?m)^## .*\(`benchmarks/(\w+)/`\)$", page)
    assert concerns == ["gpu", "pipelines", "scaling", "preemption",
                        "planning", "time_to_accuracy", "overhead"]
    assert "(history.md" in page


JOB_PAGES = {"docs/bert.md": "models.tasks.run_pretraining",
             "docs/image-job.md": "models.tasks.train_image_classifier"}


def job_flags(module: str) -> set:
    """The flags an entry point defines (not absl's), from a fresh process
    (the two jobs cannot share one: both define their common flags)."""
    import subprocess
    import sys
    code = ("import sys; sys.argv = ['x']; import importlib; "
            f"importlib.import_module({module!r}); from absl import flags; "
            "import re; print(' '.join(f.name for m, fl in flags.FLAGS."
            "flags_by_module_dict().items() if m.split('.')[0] in "
            "('models', 'tfscale', 'input_pipelines', 'launch') or "
            "re.match(r'\\w+ \\(\\d+\\) ', m) for f in fl))")
    output = subprocess.run([sys.executable, "-c", code], cwd=REPO,
                            capture_output=True, text=True, check=True)
    return set(output.stdout.split())


ABSL = {"flagfile", "helpfull", "help", "helpshort", "verbosity"}


@pytest.mark.parametrize("page", sorted(JOB_PAGES))
def test_a_jobs_flag_page_names_every_flag_and_no_other(page):
    # The page's tables (lines that start with "|") name every flag the job
    # defines; its flag reference rows ("| (group) |") name no other (the
    # prose around may name other tools' flags).
    lines = (REPO / page).read_text().splitlines()
    defined = job_flags(JOB_PAGES[page])

    def named(rows):
        return {m.group(1) for row in rows for m in FLAG.finditer(row)}
    tables = named(line for line in lines if line.startswith("|"))
    reference = named(line for line in lines if line.startswith("| ("))
    assert defined - tables == set(), f"{page} does not name these flags"
    assert reference - defined - ABSL == set(), (
        f"{page} names flags the job lacks")


@pytest.mark.parametrize("command", [
    ["run_pretraining.py"], ["train_image_classifier.py"], ["export_bert.py"],
    ["-m", "input_pipelines.create_pretraining_data"],
    ["-m", "input_pipelines.build_image_records"],
    ["-m", "input_pipelines.index_records"],
    ["-m", "input_pipelines.make_demo_images"],
    ["-m", "input_pipelines.make_demo_corpus"]])
def test_help_lists_the_flags(command):
    import subprocess
    import sys
    module = (command[1] if command[0] == "-m" else
              {"run_pretraining.py": "models.tasks.run_pretraining",
               "train_image_classifier.py":
                   "models.tasks.train_image_classifier",
               "export_bert.py": "models.tasks.export_bert"}[command[0]])
    # The three processes at once (each imports TensorFlow).
    helps = {option: subprocess.Popen(
        [sys.executable, *command, option], cwd=REPO, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        for option in ("--help", "--helpfull")}
    defined = job_flags(module)

    def sections(option):
        """{flag: the heading it is listed under}."""
        output = helps[option].communicate(timeout=120)[0]
        where, heading = {}, None
        for line in output.splitlines():
            if re.match(r"^\S.*:$", line):
                heading = line
            flag = re.match(r"^  (?:-[\w?]+,)?--(?:\[no\])?([a-z0-9_]+)", line)
            if flag:
                where[flag.group(1)] = heading
        return where, output
    grouped, output = sections("--help")
    listed = set(grouped)
    assert defined <= listed and listed, output[-2000:]
    # Only the program's own: not flags a library defines on import.
    assert not listed & {"delta_threshold", "hbm_oom_exit"}, listed
    # Grouped as --helpfull groups them.
    full, _ = sections("--helpfull")
    assert {f: full[f] for f in listed} == grouped
    # A job's groups are its page's: each "| (N) name |" row's flags under
    # the heading "<program> (N) name:".
    page = {v: k for k, v in JOB_PAGES.items()}.get(module)
    if page:
        program = module.rsplit(".", 1)[1]
        rows = 0
        for line in (REPO / page).read_text().splitlines():
            row = re.match(r"^\| \((\d+)\) ([^|(]+?) \|(.*)$", line)
            if not row:
                continue
            rows += 1
            heading = f"{program} ({row.group(1)}) {row.group(2)}:"
            for flag in {m.group(1) for m in FLAG.finditer(row.group(3))}:
                if flag in defined:
                    assert grouped[flag] == heading, (page, flag)
        assert rows >= 4, page
    if module == "models.tasks.export_bert":
        for flag in ("checkpoint", "bert_config_file", "output_dir"):
            assert re.search(rf"--{flag}: [^\n]*\(required\)", output), flag


def test_the_readmes_timings_are_the_benchmarks():
    """The demo's time the README quotes is a run benchmarks/README.md
    records, with its command."""
    readme = (REPO / "README.md").read_text()
    quoted = re.search(r"last measured run, [^:]*: ([\d.]+) s, ([\d.]+) s "
                       r"of it training", " ".join(readme.split()))
    assert quoted, "README.md quotes no demo time"
    runs = (REPO / "benchmarks" / "README.md").read_text()
    section = " ".join(runs[runs.index("## End-to-end runs"):].split())
    recorded = re.findall(r"([\d.]+) s in all, ([\d.]+) s of training",
                          section)
    assert quoted.groups() in recorded, (quoted.groups(), recorded)


def test_the_quick_tests_are_the_ones_the_table_marks():
    """`make test-quick` runs the files docs/tests.md marks quick, and the
    table has a row for every test file."""
    makefile = (REPO / "Makefile").read_text()
    block = makefile[makefile.index("QUICK_TESTS ="):
                     makefile.index("test-quick: install-test")]
    quick = set(re.findall(r"tests/(test_\w+\.py)", block))
    rows = dict(re.findall(r"^\| `tests/(test_\w+\.py)` \|.*\| (yes|-) \|$",
                           (REPO / "docs" / "tests.md").read_text(), re.M))
    assert set(rows) == {p.name for p in (REPO / "tests").glob("test_*.py")}
    assert {name for name, mark in rows.items() if mark == "yes"} == quick


@pytest.mark.parametrize("page", ["README.md", "docs/launching.md"])
def test_the_exit_code_tables_hold_the_contracts_codes(page):
    """A SLURM script decides on these codes: each of the contract's has
    its row, and a row's "restarted" says what the launcher does."""
    from tfscale.cluster import contract
    text = (REPO / page).read_text()
    rows = {int(m.group(1)): m.group(0) for m in
            re.finditer(r"^\| (\d+) \|.*$", text, re.MULTILINE)}
    codes = {getattr(contract, name) for name in dir(contract)
             if name.endswith("_EXIT_CODE")}
    assert codes <= set(rows), (codes - set(rows))
    for code in (contract.CONFIG_ERROR_EXIT_CODE,
                 contract.PREEMPTED_UNSAVED_EXIT_CODE):
        assert "| no |" in rows[code], rows[code]
    for code in (contract.PREEMPTED_EXIT_CODE,
                 contract.STARTUP_TIMEOUT_EXIT_CODE, 137):
        assert "| yes |" in rows[code], rows[code]
    assert "requeue" in rows[contract.PREEMPTED_EXIT_CODE]
