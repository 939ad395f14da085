"""linattn-rerun and the suite config: parsing, hostile input, grouping, resources, summary, exit codes.

Everything runs against a small copy of the layout in tmp_path (--root), so the end-to-end runs
never recurse into this file or the real suites.
"""
from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tools.inner_pytest import LONG_WAIT, runpytest_forked
from pytest_linattn import rerun
from pytest_linattn.suites import (Suite, SuiteConfigError, _parse_mini_toml, given_flags, home_suite,
                                   load_suites, targeted_suites)

REPO = Path(__file__).resolve().parents[3]

pytest_plugins = ["pytester"]

TOML = """\
# a suite with no plugin options, so the end-to-end child pytest needs no plugin
[cpu]
gpus = 0
pytest_args = ["-p", "no:cacheprovider", "-q"]

[gpu-2]
gpus = 2
device = "cuda"
tp = "2"
cp = 2
timeout = 300

[bench]
collect = false
"""

PASSING = "def test_one():\n    assert 1 + 1 == 2\n\ndef test_two():\n    pass\n"
FAILING = "def test_ok():\n    pass\n\ndef test_bad():\n    assert 1 == 2, 'sharded output differs'\n"


@pytest.fixture
def root(tmp_path, monkeypatch):
    r = tmp_path / "repo"
    for rel, text in {
        "pytest.ini": "[pytest]\n",
        "suites/suites.toml": TOML,
        "suites/cpu/test_ok.py": PASSING,
        "suites/cpu/test_fails.py": FAILING,
        "suites/cpu/helpers.py": "",
        "suites/cpu/conftest.py": "",
        "suites/gpu-2/test_tp.py": PASSING,
        "suites/bench/bench_speed.py": "",
        "suites/bench/test_bench.py": PASSING,
        "linattn/test_outside.py": PASSING,
        "etc/passwd": "",
    }.items():
        (r / rel).parent.mkdir(parents=True, exist_ok=True)
        (r / rel).write_text(text)
    # The child pytest must not depend on (or spend time importing) the installed plugin.
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    monkeypatch.delenv("PYTEST_ADDOPTS", raising=False)
    monkeypatch.setenv(rerun.GPU_COUNT_ENV, "0")
    return r


def run(root, *argv, out=None):
    return rerun.main(["--root", str(root), "--out", str(out or root / "out"), *argv])


def groups(root, *items):
    return rerun.group_request(rerun.request_tokens(list(items)), root, load_suites(root))


# --- parsing ---

@pytest.mark.parametrize("items, tokens", [
    (["/rerun-test suites/cpu/test_ok.py"], ["suites/cpu/test_ok.py"]),
    (["/rerun-test   suites/cpu/test_ok.py \t  suites/gpu-2/test_tp.py  "],
     ["suites/cpu/test_ok.py", "suites/gpu-2/test_tp.py"]),
    (["/rerun-test suites/cpu/test_ok.py\nthis failed on main too, see #12\n/rerun-test suites/x.py"],
     ["suites/cpu/test_ok.py"]),
    (["Flaky, please:\r\n  /rerun-test suites/cpu/test_ok.py\r\n"], ["suites/cpu/test_ok.py"]),
    (["/rerun-test", "suites/cpu/test_ok.py"], ["suites/cpu/test_ok.py"]),  # unquoted on a shell
    (["suites/cpu/test_ok.py", "suites/gpu-2/test_tp.py"], ["suites/cpu/test_ok.py", "suites/gpu-2/test_tp.py"]),
])
def test_request_tokens(items, tokens):
    assert rerun.request_tokens(items) == tokens


def test_command_must_start_its_line():
    with pytest.raises(rerun.BadRequest, match="must start its line"):
        rerun.request_tokens(["please /rerun-test suites/cpu/test_ok.py"])
    # /rerun-tests is another word, not the command: its tokens are then checked as files
    assert rerun.request_tokens(["/rerun-tests a"]) == ["/rerun-tests", "a"]


def test_grouping_by_home_suite_in_config_order(root):
    got = groups(root, "/rerun-test suites/gpu-2/test_tp.py ./suites/cpu/test_ok.py suites/cpu/test_fails.py "
                       "suites/cpu/test_ok.py")
    assert got == {"cpu": ["suites/cpu/test_ok.py", "suites/cpu/test_fails.py"],
                   "gpu-2": ["suites/gpu-2/test_tp.py"]}


# --- hostile input: each rejection names the token and the rule ---

@pytest.mark.parametrize("token, rule", [
    (";", "only letters"),
    ("$(id)", "only letters"),
    ("`id`", "only letters"),
    ("suites/cpu/test_ok.py;id", "only letters"),
    ("suites/cpu/test_ok.py|sh", "only letters"),
    ("suites/cpu/test_ok.py::test_one", "only letters"),
    ("suites/cpu/test_*.py", "only letters"),
    ("-rf", "options are not accepted"),
    ("--rootdir=/", "only letters"),  # '=' is refused before the option rule
    ("--collect-only", "options are not accepted"),
    ("-p", "options are not accepted"),
    ("/", "absolute"),
    ("/etc/passwd", "absolute"),
    ("../../etc/passwd", "'..'"),
    ("suites/cpu/../../etc/passwd", "'..'"),
    ("rm", "not inside a suite folder"),
    ("linattn/test_outside.py", "not inside a suite folder"),
    ("suites/test_x.py", "not inside a suite folder"),
    ("suites/nope/test_ok.py", "unknown suite 'nope'"),
    ("suites/cpu/helpers.py", "not a test file"),
    ("suites/cpu/conftest.py", "not a test file"),
    ("suites/cpu/test_missing.py", "no such test file"),
    ("suites/bench/test_bench.py", "not a test suite"),
    ("suites/bench/bench_speed.py", "not a test suite"),
])
def test_hostile_tokens_are_refused(root, token, rule):
    with pytest.raises(rerun.BadRequest) as e:
        groups(root, f"/rerun-test {token}")
    assert e.value.lines[0].startswith(f"`{token.replace('`', chr(39))}`: ")
    assert rule in e.value.lines[0]


def test_every_bad_token_is_reported(root):
    with pytest.raises(rerun.BadRequest) as e:
        groups(root, "/rerun-test suites/cpu/test_ok.py ; rm -rf /")
    assert [line.split(":")[0] for line in e.value.lines] == ["`;`", "`rm`", "`-rf`", "`/`"]


def test_symlink_out_of_the_suite_is_refused(root):
    (root / "suites/cpu/test_link.py").symlink_to(root / "linattn/test_outside.py")
    with pytest.raises(rerun.BadRequest, match="resolves outside its suite folder"):
        groups(root, "suites/cpu/test_link.py")


def test_empty_and_oversized_requests(root):
    with pytest.raises(rerun.BadRequest, match="no test files"):
        groups(root, "/rerun-test   \nsuites/cpu/test_ok.py")
    with pytest.raises(rerun.BadRequest, match="at most"):
        groups(root, "/rerun-test " + " suites/cpu/test_ok.py" * (rerun.MAX_FILES + 1))


def test_hostile_request_exits_2_and_explains(root, capsys):
    assert run(root, "/rerun-test suites/cpu/test_ok.py $(id) `id`") == 2
    summary = (root / "out/summary.md").read_text()
    assert "refused" in summary and "`$(id)`" in summary and "`'id'`" in summary
    assert not (root / "out/cpu.xml").exists()  # nothing ran


def test_smuggled_options_on_the_command_line_are_refused(root):
    assert run(root, "suites/cpu/test_ok.py", "--collect-only") == 2
    assert "`--collect-only`: options are not accepted" in (root / "out/summary.md").read_text()


# --- resources and dry runs ---

def test_missing_gpus_refuse_the_request(root, monkeypatch, capsys):
    monkeypatch.setenv(rerun.GPU_COUNT_ENV, "1")
    assert run(root, "/rerun-test suites/gpu-2/test_tp.py suites/cpu/test_ok.py") == 2
    err = capsys.readouterr().err
    assert "suite gpu-2 needs 2 GPUs, this machine has 1: refusing suites/gpu-2/test_tp.py" in err
    assert not (root / "out/cpu.xml").exists()  # refused as a whole, not half run


def test_check_resources_counts_injected_gpus(root):
    suites = load_suites(root)
    req = {"cpu": ["suites/cpu/test_ok.py"], "gpu-2": ["suites/gpu-2/test_tp.py"]}
    assert rerun.check_resources(req, suites, gpus=2) == []
    assert len(rerun.check_resources(req, suites, gpus=0)) == 1
    assert rerun.check_resources({"cpu": ["x"]}, suites, gpus=None) == []  # no GPU asked, none counted


def test_ranks_share_a_gpu_where_asked(root, monkeypatch, capsys):
    suites = load_suites(root)
    req = {"gpu-2": ["suites/gpu-2/test_tp.py"]}
    # auto shares only where the machine is short of GPUs: NCCL wherever each rank has one
    assert [rerun.ranks_per_gpu(suites["gpu-2"], "auto", gpus) for gpus in (0, 1, 2, 8)] == [2, 2, 1, 1]
    assert rerun.ranks_per_gpu(suites["cpu"], "auto", 1) == 1 and rerun.ranks_per_gpu(suites["gpu-2"], "4", 8) == 4
    assert rerun.check_resources(req, suites, gpus=1, per_gpu="auto") == []
    assert rerun.check_resources(req, suites, gpus=0, per_gpu="2") == [
        "suite gpu-2 needs 1 GPU at 2 ranks per GPU, this machine has 0: refusing suites/gpu-2/test_tp.py"]
    monkeypatch.setenv(rerun.GPU_COUNT_ENV, "1")
    assert run(root, "--dry-run", "--ranks-per-gpu", "auto", "suites/gpu-2/test_tp.py", "suites/cpu/test_ok.py") == 0
    out = capsys.readouterr().out
    assert "--linattn-device cuda --linattn-timeout 300 --linattn-ranks-per-gpu 2 --junitxml=" in out
    assert "--linattn-ranks-per-gpu" not in next(line for line in out.splitlines() if "test_ok.py" in line)
    assert run(root, "--ranks-per-gpu", "0", "suites/cpu/test_ok.py") == 2
    assert "expected a positive integer or auto, got '0'" in capsys.readouterr().err
    result = rerun.SuiteResult("gpu-2", ["suites/gpu-2/test_tp.py"], 0, 1.0, passed=1, has_report=True,
                               transport="2 ranks on 1 GPU, collectives staged through gloo, not NCCL")
    assert ("Suite gpu-2: 2 ranks on 1 GPU, collectives staged through gloo, not NCCL (--linattn-ranks-per-gpu)."
            in rerun.summary_markdown([result]))


def test_dry_run_prints_exact_commands_without_gpus(root, capsys):
    assert run(root, "--dry-run", "/rerun-test suites/gpu-2/test_tp.py suites/cpu/test_ok.py "
                                  "suites/cpu/test_fails.py") == 0
    out = capsys.readouterr().out
    assert "Running 2 files whose home suite is cpu" in out
    assert "Running 1 file whose home suite is gpu-2" in out
    gpu_line = next(line for line in out.splitlines() if "suites/gpu-2/test_tp.py" in line)
    assert f"{sys.executable} -m pytest suites/gpu-2/test_tp.py --tp 2 --cp 2 --linattn-device cuda " \
           f"--linattn-timeout 300 --junitxml={root / 'out' / 'gpu-2.xml'}" in gpu_line
    assert not (root / "out/cpu.xml").exists()


def test_double_dash_passes_a_comment_as_one_argument(root, capsys):
    assert rerun.main(["--root", str(root), "--dry-run", "--", "/rerun-test suites/cpu/test_ok.py"]) == 0
    assert "home suite is cpu" in capsys.readouterr().out


def test_no_root_is_a_bad_request(tmp_path, capsys):
    assert rerun.main(["--root", str(tmp_path), "suites/cpu/test_ok.py"]) == 2
    assert "suites/suites.toml" in capsys.readouterr().err


# --- summary from JUnit XML ---

SAMPLE_XML = """<?xml version="1.0" encoding="utf-8"?>
<testsuites name="pytest tests"><testsuite name="gpu-2" errors="1" failures="1" skipped="1" tests="5" time="3.2">
<testcase classname="suites.gpu-2.test_tp" name="test_gdn_tp[2]" time="1.0" />
<testcase classname="suites.gpu-2.test_tp" name="test_kda_tp[2]" time="1.0">
<failure message="AssertionError: o: rel err 3.1e-01 &gt; 1e-02 at (seq 1, token 7, head 0)&#10;assert False">
def test_kda_tp(): ...
E   AssertionError: o: rel err 3.1e-01</failure></testcase>
<testcase classname="suites.gpu-2.test_tp" name="test_fixture" time="0.1">
<error message="">E   RuntimeError: NCCL error | unhandled</error></testcase>
<testcase classname="suites.gpu-2.test_tp" name="test_skip" time="0"><skipped message="needs 4 GPUs" /></testcase>
<testcase classname="suites.gpu-2.test_tp" name="test_last" time="1.0" />
</testsuite></testsuites>"""


def test_summary_from_junit(tmp_path):
    xml = tmp_path / "gpu-2.xml"
    xml.write_text(SAMPLE_XML)
    r = rerun.read_junit(xml, rerun.SuiteResult("gpu-2", ["suites/gpu-2/test_tp.py"], 1, 4.25))
    assert (r.passed, r.failed, r.errors, r.skipped, r.ok) == (2, 1, 1, 1, False)
    md = rerun.summary_markdown([r, rerun.SuiteResult("cpu", ["suites/cpu/test_ok.py"], 0, 1.0, passed=3,
                                                      has_report=True)])
    assert md.startswith("### /rerun-test failed: 5 passed, 2 failed in 5.2 s")
    assert "| gpu-2 | `suites/gpu-2/test_tp.py` | 2 | 1 | 1 | 1 | 4.2 s |" in md
    assert "| cpu | `suites/cpu/test_ok.py` | 3 | 0 | 0 | 0 | 1.0 s |" in md
    assert ("- `suites.gpu-2.test_tp::test_kda_tp[2]` (gpu-2): "
            "`AssertionError: o: rel err 3.1e-01 > 1e-02 at (seq 1, token 7, head 0)`") in md
    assert "`RuntimeError: NCCL error \\| unhandled`" in md  # from the E line, pipe escaped for the table


def test_summary_without_a_report_says_so():
    r = rerun.read_junit(Path("/nonexistent.xml"), rerun.SuiteResult("cpu", ["suites/cpu/test_x.py"], 4, 0.1))
    assert not r.ok
    assert "no report (pytest exit 4)" in rerun.summary_markdown([r])


# --- end to end: real pytest children in the tmp layout ---

def test_end_to_end_pass_then_fail(root, capfd):
    assert run(root, "/rerun-test suites/cpu/test_ok.py") == 0
    assert (root / "out/cpu.xml").is_file()
    summary = (root / "out/summary.md").read_text()
    assert summary.startswith("### /rerun-test passed: 2 passed, 0 failed")

    assert run(root, "suites/cpu/test_ok.py", "suites/cpu/test_fails.py") == 1
    out = capfd.readouterr().out
    assert "Running 2 files whose home suite is cpu" in out
    summary = (root / "out/summary.md").read_text()
    assert "### /rerun-test failed: 3 passed, 1 failed" in summary
    assert "`suites.cpu.test_fails::test_bad` (cpu): `AssertionError: sharded output differs`" in summary


def test_cancelled_run_summarises_what_finished(root):
    # SIGTERM (a cancelled CI job, `timeout`) reaches linattn-rerun while a test runs: pytest is
    # interrupted, still writes its report, and the summary keeps the finished test
    started = root / "slow_started"
    (root / "suites/cpu/test_slow.py").write_text(
        "import pathlib, time\n"
        "def test_quick():\n    pass\n"
        f"def test_slow():\n    pathlib.Path({str(started)!r}).touch()\n    time.sleep(3600)\n")
    proc = subprocess.Popen([sys.executable, "-m", "pytest_linattn.rerun", "--root", str(root),
                             "--out", str(root / "out"), "suites/cpu/test_slow.py"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + LONG_WAIT  # a backstop: the start takes seconds, minutes under load
    while not started.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=LONG_WAIT)
    assert proc.returncode == 1, out
    summary = (root / "out/summary.md").read_text()
    assert summary.startswith("### /rerun-test interrupted: 1 passed, 0 failed"), summary
    assert "(interrupted)" in summary
    assert "Suite cpu was interrupted: the test running then is not counted" in summary


# --- the suite config itself ---

def test_repository_suites_toml():
    suites = load_suites(REPO)
    assert list(suites) == ["cpu", "fla-interpret", "engines", "gpu-1", "gpu-2", "gpu-4", "scale", "bench"]
    assert suites["cpu"].pytest_options()[:4] == ["--tp", "2,4", "--cp", "2,4"]
    assert (suites["gpu-2"].gpus, suites["gpu-2"].tp, suites["gpu-2"].cp) == (2, "2", "2")
    assert suites["gpu-4"].gpus == 4 and not suites["bench"].collect
    for name in suites:
        assert (REPO / "suites" / name).is_dir()


def test_mini_toml_reads_the_repository_file_like_tomllib():
    tomllib = pytest.importorskip("tomllib")
    text = (REPO / "suites/suites.toml").read_text()
    assert _parse_mini_toml(text, Path("suites.toml")) == tomllib.loads(text)


@pytest.mark.parametrize("line, message", [
    ('gpus = "two"', "gpus = 'two'"),
    ('tp = "2,x"', "tp = '2,x'"),
    ('device = "tpu"', "device = 'tpu'"),
    ("timeout = 0", "timeout = 0"),
    ("shards = 3", "unknown key 'shards'"),
    ('fla_interpreted = "maybe"', "fla_interpreted = 'maybe'"),
], ids=["gpus", "tp", "device", "timeout", "unknown", "fla_interpreted"])
def test_config_errors_name_the_key(tmp_path, line, message):
    (tmp_path / "suites").mkdir()
    (tmp_path / "suites/suites.toml").write_text(f"[cpu]\n{line}\n")
    with pytest.raises(SuiteConfigError, match=message.replace("(", r"\(")):
        load_suites(tmp_path)


def test_targeted_suites_and_given_flags(root):
    suites = load_suites(root)
    assert targeted_suites(["suites/cpu/test_ok.py::test_one"], root, root, suites) == {"cpu"}
    assert targeted_suites(["suites/gpu-2"], root, root, suites) == {"gpu-2"}
    assert targeted_suites(["test_ok.py"], root / "suites/cpu", root, suites) == {"cpu"}
    assert targeted_suites(["."], root, root, suites) == {"cpu", "gpu-2"}  # never bench
    assert targeted_suites(["linattn"], root, root, suites) == set()
    assert home_suite(root / "suites/gpu-2/test_tp.py", root, suites) == "gpu-2"
    assert home_suite(root / "suites/suites.toml", root, suites) is None
    assert given_flags(["-x", "--tp=4", "--cp", "2", "--tpx"]) == {"--tp", "--cp"}


def test_this_file_is_marked_with_its_home_suite(request):
    assert request.node.get_closest_marker("suite").args == ("cpu",)
    assert request.node.get_closest_marker("gpus") is None
    assert isinstance(load_suites(REPO)["cpu"], Suite)


def test_a_run_of_a_whole_suite_takes_its_xdist_workers(pytester, monkeypatch):
    """suites/conftest.py: `pytest suites/cpu` gets the suite's -n / --dist (suites.toml pytest_args);
    a run of one file, a user's -n, torchrun (WORLD_SIZE) or -p no:xdist does not."""
    pytest.importorskip("xdist")
    monkeypatch.delenv("PYTEST_ADDOPTS", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    pytester.makeini("[pytest]\n")
    pytester.makefile(".toml", **{"suites/suites": '[cpu]\npytest_args = ["-n", "2", "--dist", "load"]\n'})
    (pytester.path / "suites/conftest.py").write_text((REPO / "suites/conftest.py").read_text())
    pytester.makepyfile(**{"suites/cpu/test_where": "import os\n\ndef test_where():\n"
                           "    print('worker', os.environ.get('PYTEST_XDIST_WORKER'))\n"})

    def header(result):
        return next(line for line in result.stdout.lines if line.startswith("home suites:"))

    # the whole suite: its workers, forked from one server (the inner run's stages are forks of
    # this process's fla stage: the worker server imports only what that one lacks)
    result = runpytest_forked(pytester, "suites/cpu", "-s", fla=True, rank_servers=True)
    assert header(result).endswith("-n 2, --dist load, workers forked from one server")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*2 workers*"])
    for args in (["suites/cpu/test_where.py"], ["suites/cpu", "-n", "0"], ["suites/cpu", "-p", "no:xdist"]):
        assert "-n" not in header(runpytest_forked(pytester, "--co", *args)), args
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert "-n" not in header(runpytest_forked(pytester, "--co", "suites/cpu"))
