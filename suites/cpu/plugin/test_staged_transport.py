"""The staged transport (ranks sharing a GPU, pytest_linattn.ranks.staged) on CPU tensors over gloo:
the staging copies there too, so the same code runs as on a GPU (gpu-2 and gpu-4 run these checks
on CUDA tensors of ranks on one GPU). And the option around it: how many GPUs a test needs, what
the skip, the pool's failure report and the header say."""

from __future__ import annotations

import pytest

from pytest_linattn.ranks.gpus import GpuLease, gpus_for, rank_gpus, sharing_note
from pytest_linattn.ranks.pool import NotEnoughGpus, Pool, PoolManager, RankFailure
from cases.staged_ops import assert_every_op_carried, check_every_op, refused_ops

pytest_plugins = ["pytester"]


@pytest.fixture(scope="module", params=[2, 4], ids=["2ranks", "4ranks"])
def staged_pool(request):
    pool = Pool(request.param, "cpu", backend="staged", timeout=120)
    yield pool
    pool.close()


def test_every_op_is_carried(staged_pool):
    assert_every_op_carried(staged_pool.run(check_every_op, ("cpu",), timeout=120))


def test_what_it_cannot_carry_raises_naming_the_op(staged_pool):
    refused = staged_pool.run(refused_ops, ("cpu",), timeout=120)[0]
    assert "all_reduce with ReduceOp.PREMUL_SUM" in refused["all_reduce PREMUL_SUM"]
    assert "all_reduce with ReduceOp.AVG of an integer tensor" in refused["all_reduce AVG of int"]
    if "all_reduce float8" in refused:
        assert "gloo cannot reduce float8" in refused["all_reduce float8"]
    # nothing half done: the pool still works
    assert staged_pool.run(check_every_op, ("cpu",), timeout=120)[0]["all_reduce SUM"] is None


def raise_on_one():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("rank one is unhappy")
    dist.barrier()


def test_a_failure_report_names_the_transport():
    pool = Pool(2, "cpu", backend="staged", timeout=120)
    try:
        with pytest.raises(RankFailure) as err:
            pool.run(raise_on_one, timeout=120)
    finally:
        pool.close()
    assert "raise_on_one(...) on 2 ranks (collectives staged through gloo): rank 1 failed" in str(err.value)
    assert sharing_note(4, 1) == "4 ranks on 1 GPU, collectives staged through gloo, not NCCL"
    assert sharing_note(4, 2) == "4 ranks on 2 GPUs, collectives staged through gloo, not NCCL"
    assert sharing_note(2, 2) is None


def test_ranks_share_gpus_as_asked():
    assert [gpus_for(w, 2) for w in (1, 2, 3, 4)] == [1, 1, 2, 2]
    assert gpus_for(4, 4) == gpus_for(2, 4) == 1 and gpus_for(4, 1) == 4
    assert rank_gpus(4, 2) == [0, 0, 1, 1] and rank_gpus(3, 4) == [0, 0, 0] and rank_gpus(2, 1) == [0, 1]
    with pytest.raises(ValueError, match="backend must be one of gloo, staged"):
        Pool(2, "cpu", backend="nccl")
    with pytest.raises(ValueError, match="backend must be one of staged for 4 cuda ranks on 1 GPU"):
        Pool(4, "cuda", gpu_ids=["0"], ranks_per_gpu=4, backend="nccl")


def test_a_machine_with_too_few_gpus_names_the_option(monkeypatch, tmp_path):
    manager = PoolManager("cpu", lock_dir=str(tmp_path), ranks_per_gpu=2)
    manager.device = "cuda"  # as on a one-GPU machine: the lease sees one id
    monkeypatch.setattr(GpuLease, "__init__", _one_gpu_lease(GpuLease.__init__))
    with pytest.raises(NotEnoughGpus, match=r"6 ranks at 2 ranks per GPU: needs 3 GPUs, this machine has 1 "
                                            r"\(--linattn-ranks-per-gpu N lets up to N ranks share a GPU\)"):
        manager.pool(6)


def _one_gpu_lease(init):
    def one_gpu(self, n, *, lock_dir=None, gpu_ids=None):
        init(self, n, lock_dir=lock_dir, gpu_ids=["0"])
    return one_gpu


SKIPPED = """
import pytest

@pytest.mark.gpus(2)
def test_two():
    pass

@pytest.mark.world_size(4)
def test_four():
    pass
"""


def test_skips_count_shared_gpus(pytester):
    pytester.makepyfile(test_needs=SKIPPED)
    result = pytester.runpytest("-p", "pytest_linattn", "--linattn-device", "cuda", "--linattn-ranks-per-gpu", "2",
                                "-rs", "-p", "no:xdist", "-p", "no:cacheprovider")
    result.assert_outcomes(skipped=2)
    result.stdout.fnmatch_lines(["*needs 1 GPU(s) (gpus(2) at 2 ranks per GPU); this machine has 0*",
                                 "*needs 2 GPU(s) (world_size(4) at 2 ranks per GPU); this machine has 0*"])


def test_the_option_takes_a_positive_count(pytester):
    pytester.makepyfile(test_none="def test_nothing():\n    pass\n")
    result = pytester.runpytest("-p", "pytest_linattn", "--linattn-ranks-per-gpu", "0", "-p", "no:xdist")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--linattn-ranks-per-gpu: expected a positive integer, got '0'*"])
    pytester.makeini("[pytest]\nlinattn_ranks_per_gpu = two\n")
    result = pytester.runpytest("-p", "pytest_linattn", "-p", "no:xdist")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*linattn_ranks_per_gpu: expected a positive integer, got 'two'*"])
