"""The GPU summary's per-file compile seconds (pytest_linattn.compile_log): a compile counts to the
test its own process ran then, a rank's to the test running then; every kernel loaded is logged by
its cache folder; nothing without the folder."""

import os

import pytest

from pytest_linattn import compile_log
from pytest_linattn.rerun import per_file_markdown


def test_compiles_count_to_the_test_running_then(tmp_path):
    (tmp_path / "tests-11.tsv").write_text("100.0\tstart\tsuites/a.py::t1\n110.0\tend\tsuites/a.py::t1\n"
                                           "110.5\tstart\tsuites/b.py::t2\n115.0\tend\tsuites/b.py::t2\n")
    (tmp_path / "compile-11.tsv").write_text("101.0\t2.0\tk0\n")  # the test process itself
    (tmp_path / "compile-22.tsv").write_text("105.0\t3.5\tk1\n112.0\t1.0\tk2\n")  # a rank
    rows = compile_log.per_file_seconds(tmp_path)
    assert rows["suites/a.py"] == {"tests": 10.0, "compile": 5.5, "kernels": 2}
    assert rows["suites/b.py"]["compile"] == 1.0 and rows["suites/b.py"]["tests"] == 4.5
    table = per_file_markdown(str(tmp_path))
    assert table.index("suites/a.py") < table.index("suites/b.py")  # slowest first
    assert "| `suites/a.py` | 10.0 s | 5.5 s | 2 |" in table


def test_nothing_is_logged_without_the_folder(monkeypatch, tmp_path):
    monkeypatch.delenv(compile_log.ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    compile_log.install()
    compile_log.test_started("x.py::t")
    assert list(tmp_path.iterdir()) == []
    assert per_file_markdown(None) == ""


def test_every_kernel_loaded_is_logged_by_its_cache_folder(monkeypatch, tmp_path):
    """Compiled or a cache hit: the kernel's cache folder, so the cache saved after the run keeps it."""
    knobs = pytest.importorskip("triton").knobs
    monkeypatch.setenv(compile_log.ENV, str(tmp_path))
    monkeypatch.setattr(knobs.compilation, "listener", None)
    compile_log.install()
    times = type("Times", (), {"total": 2_000_000})()
    for folder, hit in (("HASHA", False), ("HASHB", True)):
        group = {"k.json": f"/cache/{folder}/k.json", "k.cubin": f"/cache/{folder}/k.cubin"}
        knobs.compilation.listener(src=None, metadata={"name": "k"}, metadata_group=group, times=times, cache_hit=hit)
    assert compile_log.loaded_cache_folders(tmp_path) == {"HASHA", "HASHB"}
    assert len((tmp_path / f"compile-{os.getpid()}.tsv").read_text().splitlines()) == 1  # the miss
