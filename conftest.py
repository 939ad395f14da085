# Repository-level pytest setup. Benchmarks (suites/bench, scripts run with python), the live bugs'
# standalone repros (suites/live_bugs, scripts run with python) and the downstream example (its own
# project) stay out of a plain `pytest`/`pytest suites` run;
# naming them explicitly on the command line still collects them.
#
# The docs' examples: `pytest README.md docs` runs every ```python block of README.md and
# docs/**/*.md through Sybil (the `docs` extra; docs/contributing.md says why Sybil). A block
# that defines `test_*` functions is a test file: it is written to a file, imported as a module
# of its own (spawn's ranks import its functions by reference, from that file) and each test
# function is called with the fixtures its parameters name. Any other block runs as a script,
# the blocks of one page sharing a namespace, in the page's order.
from __future__ import annotations

import re
from pathlib import Path

collect_ignore = ["suites/bench", "examples", "suites/live_bugs"]

ROOT = Path(__file__).resolve().parent
_DOC_TESTS = None


def _is_doc(file_path: Path) -> bool:
    return file_path.suffix == ".md" and (file_path == ROOT / "README.md" or ROOT / "docs" in file_path.parents)


def pytest_collect_file(file_path, parent):
    global _DOC_TESTS
    if not _is_doc(Path(file_path)):
        return None
    if _DOC_TESTS is None:
        try:
            import sybil  # noqa: F401
        except ImportError:
            # pytest offers every file of a folder it walks, README.md too: only a page the
            # command line asked for needs the docs extra (a GPU machine's suites do not)
            if _asked_for(Path(file_path), parent.config):
                raise ImportError(f"{file_path} holds examples run through Sybil, which is not installed: "
                                  f"pip install -e '.[docs]'") from None
            return None
        _DOC_TESTS = _doc_examples()
    return _DOC_TESTS(file_path, parent)


def _asked_for(file_path: Path, config) -> bool:
    """Whether the command line named this page, or a folder below the root that holds it."""
    for arg in config.args:
        asked = (config.invocation_params.dir / arg.split("::")[0]).resolve()
        if asked == file_path or (asked != ROOT and asked in file_path.parents):
            return True
    return False


def _doc_examples():
    from sybil import Sybil
    from sybil.evaluators.python import PythonEvaluator
    from sybil.parsers.markdown import CodeBlockParser, SkipParser

    script = PythonEvaluator()

    def evaluate(example):
        if re.search(r"^def test_", example.parsed, re.MULTILINE):
            return _run_test_file(example)
        return script(example)

    return Sybil(parsers=[CodeBlockParser("python", evaluate), SkipParser()], patterns=["*.md"],
                 fixtures=["request"]).pytest()


def _run_test_file(example):
    """Import the block as a module (its file padded so that line numbers are the page's) and call
    its test functions with their fixtures."""
    import importlib.util
    import inspect
    import sys

    request = example.namespace["request"]
    page = Path(example.path).relative_to(ROOT)
    name = "doc_example_" + re.sub(r"\W", "_", str(page.with_suffix(""))) + f"_line{example.line}"
    folder = request.getfixturevalue("tmp_path_factory").mktemp("doc_examples")
    path = folder / f"{name}.py"
    path.write_text("\n" * example.line + example.parsed)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    tests = [fn for key, fn in vars(module).items() if key.startswith("test_") and inspect.isfunction(fn)]
    for fn in tests:
        fn(**{arg: request.getfixturevalue(arg) for arg in inspect.signature(fn).parameters})
