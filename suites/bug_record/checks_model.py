"""The bug record's checks of the model around the layer (`bug_record.checks` runs them; their words
are in `checks.CHECKS`), at the record's sizes (its layer, float64 unless a check says otherwise):

    oracle          the replicated layer against the HF-written composition over linattn.reference
                    (suites/cpu/library/test_layer_math.py's oracle, recurrent mode)
    tp-stack        TP 2 parity of a 2-layer decoder stack of the layer (suites/clients/tp_decoder.py),
                    each layer's hidden state and the output its own case (`decoder_stack`)
    isolation       document isolation of a decoder stack fed position_ids only (suites/clients/isolation.py)
    checkpoint, checkpoint-fp8  checkpoint round trips between TP 2 and TP 1 (suites/clients/checkpoint.py,
                    suites/clients/quantized_checkpoint.py)
    fresh-init      the layer class's fresh initialisation, 64 seeds, float32 and bf16

Each takes the check's subject (a planted layer class, decoder stack class or checkpoint client;
None for the project's own).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
from pathlib import Path

import torch

from bug_record.checks import CONFIG, CU, RTOL, SEED, reference
from cases.layer_parity import linattn_layer
from linattn.layers import GatedDeltaNet
from pytest_linattn.harness import Placement, assert_sharded_parity
from pytest_linattn.harness.checkpoint import assert_checkpoint_round_trip
from pytest_linattn.harness.fresh_init import assert_fresh_init_is_finite


@functools.lru_cache(maxsize=1)
def _layer_math():
    """suites/cpu/library/test_layer_math.py (its oracle and packed inputs), loaded by path."""
    path = Path(__file__).resolve().parent.parent / "cpu" / "library" / "test_layer_math.py"
    spec = importlib.util.spec_from_file_location("record_layer_math", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def oracle(cls=None):
    """test_replicated_layer_matches_reference_composition's check on the replicated layer of
    class `cls` (default the project's): output, dx and every parameter gradient <= 1e-12."""
    math_tests = _layer_math()
    math_tests.assert_layer_matches_oracle(math_tests.make_config("qwen3_5", 2), SEED, "qwen3_5-gva2", cls)


def checkpoint(spawn, io=None, quantized=False):
    from clients.checkpoint import linattn_checkpoint_io
    from clients.quantized_checkpoint import QUANTIZED_RTOL, quantized_checkpoint_io

    default = quantized_checkpoint_io(CONFIG) if quantized else linattn_checkpoint_io(CONFIG)
    assert_checkpoint_round_trip(spawn, linattn_layer(CONFIG), reference(), CU, io=io or default,
                                 sizes=((2, 1), (1, 2)), hidden_size=CONFIG.hidden_size, seed=SEED, rtol=RTOL,
                                 weight_rtol=QUANTIZED_RTOL if quantized else None, name="record")


INIT_SEEDS = range(64)


def fresh_init(cls=None):
    """Every parameter of the layer class's fresh init finite, at a production head count (32 value
    heads: a 1-in-256 draw per head shows within the seeds) on the record's small widths."""
    config = dataclasses.replace(CONFIG, num_v_heads=32)
    assert_fresh_init_is_finite(lambda dtype: (cls or GatedDeltaNet)(config, dtype=dtype), seeds=INIT_SEEDS,
                                name="record")


STACK_LAYERS = 2


@functools.lru_cache(maxsize=1)
def stack_reference():
    """The replicated decoder stack of the record's layer (suites/clients/tp_decoder.py), seeded."""
    from clients.tp_decoder import stack_reference as make

    return make(CONFIG, STACK_LAYERS, SEED)


def decoder_stack(spawn, stack_class=None):
    """TP 2 parity of a decoder stack of `stack_class` (a planted TPDecoderStack; None: the client's):
    the hidden state after each layer, then the final norm's output, each its own
    assert_sharded_parity case. AssertionError naming the outputs that are off and those right,
    then each off one's report."""
    from clients.tp_decoder import TPDecoderStack, reference_forward, tp_decoder_stack

    outputs = [(f"the hidden state after layer {k} of {STACK_LAYERS}", f"after-layer-{k}-of-{STACK_LAYERS}", k)
               for k in range(1, STACK_LAYERS + 1)] + [("the output", "output", None)]
    off, right, reports = [], [], []
    for words, tag, k in outputs:
        layer = tp_decoder_stack(CONFIG, stack_class or TPDecoderStack, layers=STACK_LAYERS, hidden_state_after=k)
        try:
            assert_sharded_parity(spawn, layer, stack_reference(), [Placement(tp=2)], CU,
                                  hidden_size=CONFIG.hidden_size, seed=SEED, rtol=RTOL,
                                  reference_forward=reference_forward(k), name=f"record/stack/{tag}")
            right.append(words)
        except AssertionError as exc:
            off.append(words)
            reports.append(str(exc))
    if off:
        raise AssertionError(f"decoder stack of {STACK_LAYERS} layers at TP 2: off: {', '.join(off)}; right: "
                             f"{', '.join(right) or 'none'}\n\n" + "\n\n".join(reports))


ISOLATION_DOCUMENTS = [6, 5, 7]  # each longer than the conv's reach (W - 1 = 3 tokens)


def isolation(stack_class=None):
    """The document-isolation check on a decoder stack of the record's layer (`stack_class` a
    planted decoder), boundaries fed as position_ids only."""
    from clients.isolation import DecoderStack, stack_call
    from pytest_linattn.harness import assert_document_isolation

    stack = (stack_class or DecoderStack)(CONFIG, seed=SEED)
    gen = torch.Generator().manual_seed(SEED)
    x = torch.randn(1, sum(ISOLATION_DOCUMENTS), CONFIG.hidden_size, generator=gen, dtype=torch.float64)
    assert_document_isolation(stack_call(stack), x, ISOLATION_DOCUMENTS, feed="position_ids", seed=SEED,
                              name="record")


def run(check, spawn, subject=None):
    """Run `check` (one of this module's, a `checks.CHECKS` key) on `subject`."""
    if check == "oracle":
        return oracle(subject)
    if check == "tp-stack":
        return decoder_stack(spawn, subject)
    if check == "isolation":
        return isolation(subject)
    if check in ("checkpoint", "checkpoint-fp8"):
        return checkpoint(spawn, subject, quantized=check == "checkpoint-fp8")
    if check == "fresh-init":
        return fresh_init(subject)
    raise ValueError(f"unknown model check {check!r}; the model checks: oracle, tp-stack, isolation, checkpoint, "
                     f"checkpoint-fp8, fresh-init")
