"""Collective mutation testing (pytest_linattn.mutation, --linattn-mutate-collectives): every
mutation's effect on real gloo ranks, the mutants a clean run yields, outcomes, the report, and
the planted pair: a test that checks only the output lets a gradient-reduction mutant survive and
names its site; a test that checks every gradient kills it."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from tools.inner_pytest import runpytest_forked
from pytest_linattn.mutation import plan, report
from pytest_linattn.mutation.mutations import MUTATIONS
from pytest_linattn.ranks.reports import RankFailure, RankTimeout

pytest_plugins = ["pytester"]


def collectives_on_rank():
    """One of each collective the mutations act on, with values that say which rank sent what."""
    r, n = dist.get_rank(), dist.get_world_size()
    out = {}
    t = torch.full((2,), float(r + 1))
    dist.all_reduce(t)
    out["all_reduce"] = t
    g = torch.empty(2 * n)
    dist.all_gather_into_tensor(g, torch.full((2,), float(r + 1)))
    out["all_gather"] = g
    rs = torch.empty(2)
    dist.reduce_scatter_tensor(rs, torch.arange(2.0 * n) + 10 * r)
    out["reduce_scatter"] = rs
    a = torch.empty(2 * n)
    dist.all_to_all_single(a, torch.arange(2.0 * n) + 10 * r)
    out["all_to_all"] = a
    b = torch.full((2,), float(r))
    dist.broadcast(b, 0)
    out["broadcast"] = b
    for i in range(2):  # a ring exchange, twice: the second receive's stale data is the first's
        buf = torch.empty(2)
        ops = [dist.P2POp(dist.irecv, buf, (r - 1) % n), dist.P2POp(dist.isend, torch.full((2,), 100.0 * i + r), (r + 1) % n)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        out[f"recv{i}"] = buf
    out["funcol"] = funcol.wait_tensor(funcol.all_reduce(torch.full((2,), float(r + 1)), "sum", dist.group.WORLD))
    return out


CLEAN = [  # what each rank of 2 gets without a mutant
    {"all_reduce": [3, 3], "all_gather": [1, 1, 2, 2], "reduce_scatter": [10, 12], "all_to_all": [0, 1, 10, 11],
     "broadcast": [0, 0], "recv0": [1, 1], "recv1": [101, 101], "funcol": [3, 3]},
    {"all_reduce": [3, 3], "all_gather": [1, 1, 2, 2], "reduce_scatter": [14, 16], "all_to_all": [2, 3, 12, 13],
     "broadcast": [0, 0], "recv0": [0, 0], "recv1": [100, 100], "funcol": [3, 3]},
]
# mutation, the op it targets (its result key), occurrence, then each rank's mutated result
EXPECTED = [
    ("all_reduce.skip", "all_reduce", 0, [[1, 1], [2, 2]]),
    ("all_reduce.twice", "all_reduce", 0, [[6, 6], [6, 6]]),
    ("all_reduce.average", "all_reduce", 0, [[1.5, 1.5], [1.5, 1.5]]),
    ("all_gather.reversed", "all_gather", 0, [[2, 2, 1, 1], [2, 2, 1, 1]]),
    ("all_gather.own_chunk", "all_gather", 0, [[1, 1, 1, 1], [2, 2, 2, 2]]),
    ("reduce_scatter.unreduced", "reduce_scatter", 0, [[0, 1], [12, 13]]),
    ("all_to_all.rotated", "all_to_all", 0, [[10, 11, 0, 1], [12, 13, 2, 3]]),
    ("broadcast.skip", "broadcast", 0, [[0, 0], [1, 1]]),
    ("recv.zeroed", "recv1", 1, [[0, 0], [0, 0]]),
    ("recv.stale", "recv1", 1, [[1, 1], [0, 0]]),
    ("all_reduce.skip", "funcol", 0, [[1, 1], [2, 2]]),
    ("all_reduce.twice", "funcol", 0, [[6, 6], [6, 6]]),
    ("all_reduce.average", "funcol", 0, [[1.5, 1.5], [1.5, 1.5]]),
]


def _plain(outs):
    return [{k: v.tolist() for k, v in o.items()} for o in outs]


@pytest.mark.parametrize("interceptor", ["library", "mode"])
def test_every_mutation_changes_its_collective_as_the_table_says(spawn, interceptor):
    assert {m for m, *_ in EXPECTED} == set(MUTATIONS)  # every mutation of the table is checked
    with plan.recording() as clean:
        assert _plain(spawn(collectives_on_rank, 2)) == CLEAN
    [(call, calls)] = clean.calls.items()
    assert call.endswith(".collectives_on_rank#1") and sorted(calls) == [0, 1] and len(calls[0]) == len(calls[1])
    # the library kernels saw every call the mode saw: mutants rerun without the mode
    assert all(rec["library_sees_all"] for rank in calls.values() for rec in rank)
    assert {m["interceptor"] for m in plan.make_mutants(clean.calls)} == {"library"}
    kinds = {"funcol": "_c10d_functional.all_reduce", "recv1": "c10d.recv_"}
    for mutation, key, occurrence, want in EXPECTED:
        op_kind = MUTATIONS[mutation].kind
        rec = next(c for c in calls[0] if c["op"] == kinds.get(key, c["op"]) and c["kind"] == op_kind
                   and c["occurrence"] == occurrence and mutation in c["mutations"])
        assert rec["function"] == "collectives_on_rank" and rec["site"].endswith(".py:" + rec["site"].rsplit(":")[-1])
        target = {"call": call, "site": rec["site"], "op": rec["op"], "occurrence": occurrence, "mutation": mutation,
                  "interceptor": interceptor}
        with plan.recording(target):
            got = _plain(spawn(collectives_on_rank, 2))
        for r in range(2):
            assert got[r][key] == want[r], (mutation, r, got[r][key])
            # nothing else changed
            assert {k: v for k, v in got[r].items() if k != key} == {k: v for k, v in CLEAN[r].items() if k != key}, mutation


class _Linear(torch.autograd.Function):
    """y = x @ w, whose backward all-reduces the input gradient (a column-parallel layer's)."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        dx = dy @ w.t()
        dist.all_reduce(dx)
        return dx, x.t() @ dy


def backward_reduce_on_rank():
    x = torch.ones(1, 2, requires_grad=True)
    _Linear.apply(x, torch.ones(2, 2) * (dist.get_rank() + 1)).sum().backward()
    return x.grad


def test_a_reduction_in_backward_is_seen_as_backward_and_mutated(spawn):
    with plan.recording() as clean:
        assert [g.tolist() for g in spawn(backward_reduce_on_rank, 2)] == [[[6, 6]]] * 2
    [ranks] = clean.calls.values()
    (rec,) = ranks[0]
    assert rec["phase"] == "backward" and rec["function"] == "_Linear.backward"
    assert rec["caller"].endswith("backward_reduce_on_rank")  # the helper's caller, in another frame
    [m] = [m for m in plan.make_mutants(clean.calls) if m["mutation"] == "all_reduce.skip"]
    with plan.recording(m):
        assert [g.tolist() for g in spawn(backward_reduce_on_rank, 2)] == [[[2, 2]], [[4, 4]]]


def summed_over_ranks(x):
    """x all-reduced where autograd is already excluded, as the kernel of a C++ extension's op
    may issue it: the library's kernels at the Autograd key do not see it, the mode does."""
    y = x.clone()
    with torch._C._AutoDispatchBelowADInplaceOrView():
        dist.all_reduce(y)
    return y


def reduce_inside_an_op_on_rank():
    t = torch.full((2,), float(dist.get_rank() + 1))
    dist.all_reduce(t)  # seen by both
    return t, summed_over_ranks(torch.full((2,), float(dist.get_rank() + 1)))


def test_the_library_registers_after_torchs_functional_autograd_kernels():
    # a process that intercepts before anything imported the functional collectives (Dynamo
    # imports them lazily): torch's own registration must still work, and its autograd kernel stay
    code = ("import sys, torch\n"
            "assert 'torch.distributed._functional_collectives' not in sys.modules\n"
            "from pytest_linattn.mutation import rank\n"
            "rank._register_library()\n"
            "import torch.distributed._functional_collectives\n"
            "has = torch._C._dispatch_has_kernel_for_dispatch_key\n"
            "assert has('_c10d_functional::all_reduce', 'ADInplaceOrView')\n"
            "assert has('c10d::allreduce_', 'Autograd')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_a_collective_only_the_mode_sees_makes_the_reruns_use_the_mode(spawn):
    with plan.recording() as clean:
        assert [[v.tolist() for v in out] for out in spawn(reduce_inside_an_op_on_rank, 2)] == [[[3, 3], [3, 3]]] * 2
    [ranks] = clean.calls.values()
    assert [rec["function"] for rec in ranks[0]] == ["reduce_inside_an_op_on_rank", "summed_over_ranks"]
    assert not any(rec["library_sees_all"] for rec in ranks[0])
    mutants = [m for m in plan.make_mutants(clean.calls) if m["mutation"] == "all_reduce.skip"]
    assert [(m["function"], m["interceptor"]) for m in mutants] == [
        ("reduce_inside_an_op_on_rank", "mode"), ("summed_over_ranks", "mode")]
    with plan.recording(mutants[1]):  # the mode reaches the collective inside the op
        assert [[v.tolist() for v in out] for out in spawn(reduce_inside_an_op_on_rank, 2)] == [
            [[3, 3], [1, 1]], [[3, 3], [2, 2]]]


def ddp_grad_on_rank():
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 1, bias=False))
    model(torch.full((1, 2), float(dist.get_rank() + 1))).sum().backward()
    return model.module.weight.grad


def test_ddp_reducer_reduction_can_be_skipped(spawn):
    # DDP's C++ reducer all-reduces in backward; its Work must carry a future with the tensors
    with plan.recording() as clean:
        assert [g.tolist() for g in spawn(ddp_grad_on_rank, 2)] == [[[1.5, 1.5]]] * 2
    skip = [m for m in plan.make_mutants(clean.calls) if m["mutation"] == "all_reduce.skip" and m["phase"] == "backward"]
    assert skip, clean.calls
    with plan.recording(skip[0]):
        assert [g.tolist() for g in spawn(ddp_grad_on_rank, 2)] == [[[0.5, 0.5]], [[1.0, 1.0]]]


def _rec(site, op, occurrence, mutations, kind="all_reduce"):
    return {"op": op, "kind": kind, "site": site, "function": "f", "caller": "", "phase": "forward",
            "group_size": 2, "occurrence": occurrence, "mutations": mutations}


def test_mutants_only_where_every_rank_made_the_call_and_spread_over_sites():
    both = ["all_reduce.skip", "all_reduce.twice"]
    calls = {"m.f#1": {0: [_rec("a.py:1", "c10d.allreduce_", 0, both), _rec("b.py:2", "c10d.allreduce_", 0, both)],
                 1: [_rec("a.py:1", "c10d.allreduce_", 0, both), _rec("b.py:2", "c10d.allreduce_", 0, ["all_reduce.skip"])]}}
    mutants = plan.make_mutants(calls)
    assert [(m["site"], m["mutation"]) for m in mutants] == [
        ("a.py:1", "all_reduce.skip"), ("a.py:1", "all_reduce.twice"), ("b.py:2", "all_reduce.skip")]
    # within a site: every mutation of its first call before its later calls
    calls = {"m.f#1": {0: [_rec("a.py:1", "c10d.allreduce_", k, both) for k in range(2)]}}
    assert [(m["occurrence"], m["mutation"]) for m in plan.make_mutants(calls)] == [
        (0, "all_reduce.skip"), (0, "all_reduce.twice"), (1, "all_reduce.skip"), (1, "all_reduce.twice")]
    # a bound of 2 takes each site's first mutant before any site's second
    assert [(m["site"], m["mutation"]) for m in plan.select(mutants, 2)] == [
        ("a.py:1", "all_reduce.skip"), ("b.py:2", "all_reduce.skip")]


def test_outcomes():
    assert plan.classify(None)[0] == "survived"
    assert plan.classify(AssertionError("x"))[0] == "killed"
    assert plan.classify(RankTimeout("f(...) on 2 ranks: timed out"))[0] == "timeout"
    assert plan.classify(RankFailure("rank 1 raised:\nTraceback...\nAssertionError: y differs"))[0] == "killed"
    assert plan.classify(RankFailure("rank 1 raised:\nTraceback...\nRuntimeError: shape"))[0] == "error"
    assert plan.classify(RankFailure("rank 0 died (exit code -11)"))[0] == "error"
    assert plan.classify(ValueError("v"))[0] == "error"


def test_equivalence_rules_need_a_reason_and_a_known_mutation():
    with pytest.raises(ValueError, match="reason= is required"):
        report.equivalence_rule(("f",), {"mutation": "all_reduce.skip"})
    with pytest.raises(ValueError, match="mutation must name one of"):
        report.equivalence_rule(("f", "all_reduce.skipped"), {"reason": "r"})
    rule = report.equivalence_rule(("*/norm.py:*", "all_reduce.*"), {"reason": "a replicated value"})
    mutant = _rec("pkg/norm.py:12", "c10d.allreduce_", 0, []) | {"mutation": "all_reduce.twice"}
    assert report.equivalent_reason(mutant, [rule]) == "a replicated value"
    assert report.equivalent_reason(mutant | {"mutation": "all_gather.reversed"}, [rule]) is None


PLANTED = '''
import pytest
import torch
import torch.distributed as dist

from pytest_linattn import assert_parity


def layer_on_rank():
    """TP 2: y = (x @ w) * g with w's columns split over the ranks and g (one scale per column of
    a head, like a norm's weight) replicated: g's gradient is partial on each rank until summed."""
    r = dist.get_rank()
    gen = torch.Generator().manual_seed(0)
    x, w, g = (torch.randn(*s, generator=gen, dtype=torch.float64) for s in ((3, 4), (4, 4), (2,)))
    w_local = w[:, 2 * r:2 * r + 2].clone().requires_grad_()
    g_local = g.clone().requires_grad_()
    y_local = (x @ w_local) * g_local
    y_local.sum().backward()
    dist.all_reduce(g_local.grad)  # the replicated weight's gradient reduction
    return y_local.detach(), w_local.grad, g_local.grad


def reference():
    gen = torch.Generator().manual_seed(0)
    x, w, g = (torch.randn(*s, generator=gen, dtype=torch.float64) for s in ((3, 4), (4, 4), (2,)))
    w.requires_grad_(), g.requires_grad_()
    y = (x @ w) * g.repeat(2)
    y.sum().backward()
    return y.detach(), w.grad, g.grad


@pytest.mark.equivalent_mutant("layer_on_rank", "all_reduce.average", reason="planted: the marker's own check")
def test_output_only(spawn):
    ranks = spawn(layer_on_rank, 2)
    assert_parity(torch.cat([y for y, _, _ in ranks], dim=1), reference()[0], rtol=1e-12, name="y")


def test_every_gradient(spawn):
    ranks = spawn(layer_on_rank, 2)
    y, dw, dg = reference()
    assert_parity(torch.cat([y for y, _, _ in ranks], dim=1), y, rtol=1e-12, name="y")
    assert_parity(torch.cat([w for _, w, _ in ranks], dim=1), dw, rtol=1e-12, name="dw")
    for rank, (_, _, g) in enumerate(ranks):
        assert_parity(g, dg, rtol=1e-12, name=f"dg on rank {rank}")
'''


def test_planted_output_only_test_lets_the_gradient_reduction_mutant_survive(pytester):
    pytester.makepyfile(test_planted=PLANTED)
    result = runpytest_forked(pytester, "-p", "pytest_linattn", "--linattn-device", "cpu", "-p", "no:xdist",
                              "--linattn-mutate-collectives", "--linattn-report", "report")
    text = result.stdout.str()
    assert result.ret == 1, text  # both tests passed, a mutant survived: the session fails
    result.assert_outcomes(passed=2)
    rows = json.loads((pytester.path / "report" / report.JSON_NAME).read_text())
    written = (pytester.path / "test_planted.py").read_text().splitlines()
    site = f"test_planted.py:{1 + next(i for i, line in enumerate(written) if 'dist.all_reduce(g_local.grad)' in line)}"
    by_test = {}
    for row in rows:
        assert {"test", "site", "function", "op", "mutation", "phase", "outcome"} <= set(row)
        by_test.setdefault(row["test"].split("::")[-1], []).append(row)
    output_only = {r["mutation"]: r for r in by_test["test_output_only"]}
    assert set(output_only) == {"all_reduce.skip", "all_reduce.twice", "all_reduce.average"}
    for r in output_only.values():
        assert (r["site"], r["function"], r["op"], r["phase"]) == (site, "layer_on_rank", "c10d.allreduce_", "forward")
    assert output_only["all_reduce.skip"]["outcome"] == "survived" and not output_only["all_reduce.skip"]["equivalent"]
    assert output_only["all_reduce.average"]["equivalent"] == "planted: the marker's own check"
    assert {r["outcome"] for r in by_test["test_every_gradient"]} == {"killed"}
    assert len(by_test["test_every_gradient"]) == 3
    # the terminal: the survivor with its site, the score per test, the declared one apart
    assert f"SURVIVED test_planted.py::test_output_only: {site} (layer_on_rank) c10d.allreduce_ all_reduce.skip" in text
    assert "test_planted.py::test_output_only: 0/2 killed" in text and "1 equivalent" in text
    assert "test_planted.py::test_every_gradient: 3/3 killed" in text
    assert "missing reduction" in text


def test_spawn_calls_are_named_by_function_so_a_cached_call_does_not_shift_the_target():
    target = {"call": f"{__name__}.ddp_grad_on_rank#1", "site": "s", "op": "o", "occurrence": 0,
              "mutation": "all_reduce.skip"}
    clean = plan.Recording()
    assert clean.next_message(collectives_on_rank) == {"target": None, "interceptor": "both"}  # every call recorded
    rerun = plan.Recording(target)  # the rerun skips the first call (cached by the test): same name still
    assert rerun.next_message(ddp_grad_on_rank) == {"target": {k: target[k] for k in ("site", "op", "occurrence", "mutation")},
                                                    "interceptor": "mode"}
    assert rerun.next_message(ddp_grad_on_rank) is None  # the second call of it: not intercepted


def test_a_rerun_that_never_makes_the_mutants_call_is_an_error_not_a_survivor():
    mutant = {"call": "m.f#1", "site": "s", "op": "c10d.allreduce_", "occurrence": 0, "mutation": "all_reduce.skip"}
    [result] = plan.run_mutants(lambda: None, [mutant])
    assert result["outcome"] == "error" and "not reached" in result["detail"]


def test_the_bound_is_a_positive_whole_number():
    from pytest_linattn.options import OPTIONS

    parse = OPTIONS["mutants_per_test"].parse
    assert parse("8", "--linattn-mutants-per-test") == 8 and parse(3, "linattn_mutants_per_test") == 3
    for bad in ("0", "-1", "two", "1.5", True):
        with pytest.raises(ValueError, match="--linattn-mutants-per-test: expected a positive integer"):
            parse(bad, "--linattn-mutants-per-test")


def test_under_torchrun_it_is_a_usage_error_not_ignored(pytester, monkeypatch):
    pytester.makepyfile("def test_x(): pass")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    result = pytester.runpytest("-p", "pytest_linattn", "-p", "no:xdist", "--linattn-mutate-collectives")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--linattn-mutate-collectives does not run under torchrun*"])
