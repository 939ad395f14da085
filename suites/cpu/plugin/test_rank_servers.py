"""Where a pool's ranks come from (pytest_linattn.ranks.servers): CPU ranks forked from a server
forked from stages that imported torch (and fla) once, in this process's environment of now; CUDA ranks spawned; a
forked pytest run's (suites/tools/inner_pytest.py) rank servers cold, or forked from its own server.

That no rank and no server outlives its pytest (Ctrl-C, SIGKILL) is test_spawn_pools'
test_no_rank_outlives_its_pytest; that two xdist workers' pools never meet, its
test_xdist_pools_never_collide.
"""
from __future__ import annotations

import importlib.util
import os
import sys

import pytest

from pytest_linattn.ranks import servers
from pytest_linattn.ranks.pool import Pool, PoolManager, xdist_thread_share

pytest_plugins = ["pytester"]


def rank_facts(name):
    import torch

    return {"ppid": os.getppid(), "pid": os.getpid(), "env": os.environ.get(name),
            "threads": torch.get_num_threads(), "fla": "fla" in sys.modules}


def _cmdline(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="servers run on Linux")
def test_cpu_ranks_are_forks_of_a_server_in_the_environment_of_now(monkeypatch):
    with PoolManager("cpu") as pools:
        pools.run(rank_facts, 2, ("UNSET",))  # the server exists from here on
        server = pools.pool(2).starter.parent_pid
        pools.close()
        # set after the server started: the ranks still see it, and thread share applies
        monkeypatch.setenv("LINATTN_SERVER_PROBE", "seen")
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        facts = pools.run(rank_facts, 2, ("LINATTN_SERVER_PROBE",))
        pool = pools.pool(2)
    assert pool.starter.method.startswith("forked from a preloaded server")
    assert pool.starter.parent_pid == server != os.getpid()
    assert "multiprocessing.forkserver" in _cmdline(server) and "'torch'" in _cmdline(server)
    assert [f["ppid"] for f in facts] == [server, server]
    assert [f["env"] for f in facts] == ["seen", "seen"]
    assert [f["threads"] for f in facts] == [xdist_thread_share(2)] * 2


def test_fla_pools_once_fla_is_used_and_an_emulated_call_replaces_a_torch_pool(monkeypatch):
    pytest.importorskip("fla")
    from linattn.emulation import active_modes, fla_on_cpu

    if not servers.can_preload_fla("cpu"):
        pytest.skip("fla is not preloaded here (a GPU is visible, or TRITON_INTERPRET is set)")
    monkeypatch.setattr(servers, "process_uses_fla", lambda: False)
    with PoolManager("cpu") as pools:
        plain = pools.run(rank_facts, 2, ("UNSET",))
        assert not pools.pool(2).fla and not any(f["fla"] for f in plain)
        with fla_on_cpu():
            emulated = pools.run(rank_facts, 2, ("UNSET",), fla_on_cpu=active_modes())
        assert pools.pool(2).fla and all(f["fla"] for f in emulated)
        assert {f["pid"] for f in emulated}.isdisjoint(f["pid"] for f in plain)  # a new pool
        again = pools.run(rank_facts, 2, ("UNSET",))  # a plain call keeps the fla pool
        assert [f["pid"] for f in again] == [f["pid"] for f in emulated]
        monkeypatch.setattr(servers, "process_uses_fla", lambda: True)
        pools.close()
        assert all(f["fla"] for f in pools.run(rank_facts, 2, ("UNSET",)))


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="servers run on Linux")
def test_servers_are_forks_of_the_stages_that_imported_torch_and_fla_once():
    """Each rank server is forked from the longest stage its imports extend (torch; torch and
    fla), so a process imports torch, and fla, once for all of them."""
    root = servers.preloaded_server(servers.ROOT_PRELOAD)
    base = servers.preloaded_server(servers.BASE_PRELOAD)
    assert _parent(base._forkserver_pid) == root._forkserver_pid != os.getpid()
    assert _parent(root._forkserver_pid) == os.getpid()
    if servers.can_preload_fla("cpu") and importlib.util.find_spec("fla"):
        fla_stage = servers.preloaded_server(servers.FLA_ROOT_PRELOAD)
        fla = servers.preloaded_server(servers.FLA_PRELOAD)
        assert _parent(fla._forkserver_pid) == fla_stage._forkserver_pid
        # an xdist worker the suites start warm is a fork of a server that imported torch and fla
        # (suites/conftest.py): its fla stage is a fork of that server, not of its torch stage
        stage_parent = os.getppid() if servers.fla_stage_from_parent_server() else root._forkserver_pid
        assert _parent(fla_stage._forkserver_pid) == stage_parent
    assert servers.preloaded_server(servers.BASE_PRELOAD) is base  # one per preload and environment


def test_spawn_where_a_fork_is_unsafe_or_asked_against(monkeypatch):
    assert servers.starter("cuda", True).method == "spawn"  # a forked CUDA context is unusable
    assert not servers.can_preload_fla("cuda")
    monkeypatch.setenv("LINATTN_RANK_START", "spawn")
    start = servers.starter("cpu", True)
    assert start.method == "spawn" and start.parent_pid == os.getpid() and not start.fla
    monkeypatch.delenv("LINATTN_RANK_START")
    # under fla_interpreted (TRITON_INTERPRET=1, part of a server's key) an fla server imports fla
    # with its kernels interpreted; the fla-interpret suite's CP test checks its ranks run them so
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from pytest_linattn.ranks.gpus import gpu_count

    assert servers.can_preload_fla("cpu") == (gpu_count() == 0)


def test_spawned_ranks_still_work(monkeypatch):
    monkeypatch.setenv("LINATTN_RANK_START", "spawn")
    pool = Pool(2, "cpu", timeout=120)
    try:
        facts = pool.run(rank_facts, ("LINATTN_RANK_START",))
    finally:
        pool.close()
    assert [f["ppid"] for f in facts] == [os.getpid()] * 2 and [f["env"] for f in facts] == ["spawn"] * 2


RANK_SERVER_OF_A_FORKED_RUN = r'''
import os


def parent_of(pid):
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def server_and_its_parents():
    stage = parent_of(os.getppid())
    return os.getppid(), stage, parent_of(stage)


def test_where(spawn):
    (server, stage, parent), _ = spawn(server_and_its_parents, 2)
    with open("where.txt", "w") as f:
        f.write(f"{os.getpid()} {server} {stage} {parent}")
'''


@pytest.mark.parametrize("rank_servers", [False, True], ids=["cold", "forked"])
def test_a_forked_pytest_runs_rank_servers_of_its_own_or_forked_from_its_server(pytester, rank_servers):
    """suites/tools/inner_pytest.py: the inner session's rank server is a fork of its torch stage, which
    is its own child (cold), or, with rank_servers=True, a fork of the server the inner session
    itself was forked from."""
    from tools.inner_pytest import _START_ENVIRON, runpytest_forked

    pytester.makepyfile(test_where=RANK_SERVER_OF_A_FORKED_RUN)
    runpytest_forked(pytester, "-p", "pytest_linattn", rank_servers=rank_servers).assert_outcomes(passed=1)
    inner, server, stage, parent = map(int, (pytester.path / "where.txt").read_text().split())
    zygote = servers.preloaded_server(servers.ROOT_PRELOAD, environ=_START_ENVIRON)._forkserver_pid
    assert parent == (zygote if rank_servers else inner) and len({inner, server, stage, zygote}) == 4
