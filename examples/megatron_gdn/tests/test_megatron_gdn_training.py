"""megatron-core's GatedDeltaNet inside Megatron's own training step, against the project's float64
GDN layer trained alike (pytest-linattn's assert_training_parity).

On the ranks: the layer wrapped in Megatron's DistributedDataParallel, 2 micro-batches of
different packings (THD, PackedSeqParams) accumulating in DDP's grad buffer, Megatron's
finalize_model_grads, its optimizer's gradient norm (FP32Optimizer.get_grad_norm: the parameters
it counts, reduced over the model-parallel group), clipping that bites (MAX_NORM under every
step's norm) by clip_grad_by_total_norm_fp32's arithmetic, AdamW; 2 steps. After each step: the
loss, every rank's gradient norm, every gradient and every parameter (megatron_gdn.training).
With 2 data-parallel replicas too (4 micro-batches a step, 2 on each; DDP's DP x CP all-reduce).

Tolerance: RTOL = 1e-6 as in test_megatron_gdn.py (Megatron's alpha / gate float32 casts); the
gradient norm adds get_grad_norm_fp32's float32 sum (measured: 1e-8 to 3e-8).
"""

import pytest
import torch

from megatron_gdn import cpu
from megatron_gdn.client import CONFIG
from megatron_gdn.training import megatron_gdn_training, megatron_training_step
from pytest_linattn import assert_training_parity
from pytest_linattn.parity import capture_records
from test_megatron_gdn import CP2, RTOL, TP2, TP2_CP2, TP2_CP2_SP, TP2_SP, reference

pytestmark = pytest.mark.usefixtures("fla_on_cpu")

MAX_NORM = 5.0  # the reference's norms are 10.5 and 11.3 (seed 6), 14.8 and 16.8 (seed 7)
# two micro-batches of 32 tokens, packed differently; every sequence a multiple of 2 x cp (THD
# under CP), sequences crossing the TP (SP) and CP shard edges
MICRO_BATCHES = [[0, 8, 24, 32], [0, 24, 32]]


def train(spawn, placements, seed, data_parallel=1, step=megatron_training_step(MAX_NORM)):
    steps = assert_training_parity(spawn, megatron_gdn_training(packed=True), reference(seed), placements,
                                   MICRO_BATCHES * data_parallel, hidden_size=CONFIG.hidden_size, seed=seed,
                                   rtol=RTOL, step=step, name="megatron-train", data_parallel=data_parallel)
    assert all(s["clipped"] for s in steps), f"clipping must bite on every step: {steps}"


def test_training_steps_with_sp_and_cp(spawn):
    train(spawn, [TP2_SP, CP2, TP2_CP2_SP], seed=6)


def test_training_steps_with_data_parallel_replicas(spawn):
    # 2 DP replicas (parallel_state's data-parallel size: world / (tp x cp)), 2 micro-batches each:
    # DDP's all-reduce over DP x CP sums what each replica accumulated
    train(spawn, [TP2_SP, CP2], seed=6, data_parallel=2)


def zero_only_the_optimizer(ddp, optimizer):
    """A hand-written loop's zeroing that forgets DDP's grad buffers: main_grad keeps step 1."""
    optimizer.zero_grad(set_to_none=True)


def test_a_step_that_leaves_ddp_grad_buffers_unzeroed_is_caught(spawn):
    with capture_records(), pytest.raises(AssertionError) as info:  # meant to fail: kept out of the table
        train(spawn, [TP2_SP], seed=6, step=megatron_training_step(MAX_NORM, zero=zero_only_the_optimizer))
    text = str(info.value)
    assert "step 1/2" not in text, text  # step 1 starts from zeroed buffers
    assert "step 2/2 (2 micro-batches) grad norm: the reference's is" in text, text
    assert "step 2/2 (2 micro-batches) grad: " in text, text


@pytest.mark.xfail(strict=True, raises=AssertionError, reason=(
    "Megatron-LM #7452 through a training step: with sequence parallel off, finalize_model_grads "
    "leaves out_norm.weight's gradient partial on each TP rank (step 1: relative error 0.64 on TP "
    "rank 0, TP ranks differ by up to 0.27); Megatron's grad norm counts it once, from TP rank 0, so "
    "it is off too (3.5e-4, step 1); the TP replicas of out_norm.weight part after the first "
    "optimizer step (differ by 0.020; error 6.2e-3) and at step 2 the loss (7.8e-3), every gradient "
    "(5e-3 to 8e-3) and every weight (1e-4 to 1e-3) are off"))
@pytest.mark.parametrize("placement", [TP2, TP2_CP2], ids=["tp2", "tp2-cp2"])
def test_training_steps_without_sp(spawn, placement):
    try:
        train(spawn, [placement], seed=7)
    except AssertionError as exc:
        unexplained = step_1_failures_not_from_out_norm(str(exc))
        if unexplained:  # only the known bug may xfail this test
            pytest.fail("failed, but not only on out_norm.weight (and the grad norm counting it) at step 1:\n\n"
                        + "\n\n".join(unexplained))
        raise


def step_1_failures_not_from_out_norm(report):
    """The step-1 checks of an assert_training_parity report that #7452 does not explain: out_norm.
    weight's gradient or value (norm.weight in the reference's names) and the gradient norm are."""
    blocks = [b for b in report.split("\n\n")[1:] if " step 1/" in b]
    if not any("grad module.out_norm.weight" in b for b in blocks):
        return ["out_norm.weight's gradient did not fail at step 1", *blocks]
    unexplained = []
    for block in blocks:
        head, *rows = block.splitlines()
        if " grad norm: " in head or " module.out_norm.weight: " in head:
            continue
        # a parity table: the header line, then one row per failing tensor
        if "parity failed" in head and rows[1:] and all(r.split()[0] == "norm.weight" for r in rows[1:]):
            continue
        unexplained.append(block)
    return unexplained


def test_megatron_clip_cannot_run_on_a_cpu():
    """Why `megatron_gdn.training.clip` runs clip_grad_by_total_norm_fp32's arithmetic rather than
    the function (and grad_norm needs cpu.cuda_tensors_on_cpu): if this fails, Megatron has
    changed, and the example can call it."""
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32, get_grad_norm_fp32

    param = torch.nn.Parameter(torch.ones(3))
    param.grad = torch.ones(3)  # float32, as Megatron's main grads
    with cpu.cuda_tensors_on_cpu(), pytest.raises(AssertionError):
        clip_grad_by_total_norm_fp32([param], 1.0, 2.0)  # assert param.grad.type() == 'torch.cuda.FloatTensor'
    with pytest.raises((AssertionError, RuntimeError), match="CUDA"):
        get_grad_norm_fp32([param.grad])  # torch.zeros(1, device='cuda') without the shim
