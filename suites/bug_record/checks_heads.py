"""The record's checks of the key-head pairing and of process-wide state (bug_record.checks runs
them), and the located lines of their plants (bug_record.plants_heads), derived from the sizes:

    head-pairing       assert_head_pairing at TP 2 on the record's layer (qwen3_5 layout, 4 key heads,
                       8 value heads, grouped): a prefill call and a decode step, the key head each value
                       head reads observed on the ranks against the config's pairing, and both runs
                       against the float64 reference
    head-pairing-next  the same on a Qwen3-Next layer (qwen3_next layout, the same sizes)
    shared-process     assert_layers_share_a_process at TP 2: the record's layer and a second GDN layer
                       of another key-head layout (2 key heads of 16 channels, 8 value heads) built in
                       the same rank processes, then each run against its reference
"""

from __future__ import annotations

import dataclasses
import functools
import re

import torch

from bug_record.checks import CONFIG, CU, RTOL, SEED
from cases.layer_parity import linattn_layer, linattn_state_path, make_config, random_state_dict
from linattn.heads import HEAD_PAIRINGS, key_head_of
from linattn.layers import LinearAttentionConfig, build_layer
from pytest_linattn.harness import ParityCase, Placement, assert_head_pairing, assert_layers_share_a_process

NEXT_CONFIG = make_config("qwen3_next", 2)
# the second layer of the shared-process check: other key heads (2 of 16 channels: the same q and k
# widths per rank as the record's 4 of 8 at TP 2), the same hidden size and value heads
SECOND_CONFIG = dataclasses.replace(CONFIG, num_k_heads=2, head_k_dim=16)
TP = 2


@functools.lru_cache(maxsize=4)
def reference_of(config: LinearAttentionConfig):
    """The replicated layer of `config` (float64, the record's seeded weights)."""
    layer = build_layer(config, dtype=torch.float64)
    layer.load_state_dict(random_state_dict(config, SEED))
    return layer


def head_pairing(spawn, path=None, config=CONFIG):
    assert_head_pairing(spawn, path or linattn_state_path(config), reference_of(config), [Placement(tp=TP)],
                        seed=SEED, rtol=RTOL, name="record")


def case_name(config) -> str:
    return f"record/{config.num_k_heads}-key-heads/tp{TP}/seed{SEED}"


def shared_process(spawn, cls=None):
    """The record's layer and SECOND_CONFIG's, built in that order in the same rank processes
    (`cls`: a planted layer class for both), then run."""
    gen = torch.Generator().manual_seed(SEED)
    x, dy = (torch.randn(1, CU[-1], CONFIG.hidden_size, generator=gen, dtype=torch.float64) for _ in range(2))
    cases = []
    for config in (CONFIG, SECOND_CONFIG):
        layer = linattn_layer(config)
        if cls is not None:
            from bug_record.plants_layer import planted_layer

            layer = planted_layer(config, cls)
        cases.append(ParityCase(layer, Placement(tp=TP), reference_of(config), torch.tensor(CU), x, dy, RTOL,
                                name=case_name(config)))
    assert_layers_share_a_process(spawn, cases)


# ---- located lines ------------------------------------------------------------------------------


def reads_on_ranks(config, split_pairing: str, local_pairing: str, tp: int = TP) -> list[int]:
    """The key head each value head reads when the TP split hands out value heads as `split_pairing`
    pairs them and each rank's recurrence pairs its own heads as `local_pairing` does."""
    split = dataclasses.replace(config, head_pairing=split_pairing)
    local, replicas = config.local(tp), config.key_head_replicas(tp)
    reads = [None] * config.num_v_heads
    for t in range(tp):
        key0 = t // replicas * local.num_k_heads
        for j, head in enumerate(split.value_heads_of_rank(tp, t)):
            reads[head] = key0 + key_head_of(j, local.num_k_heads, local.num_v_heads, local_pairing)
    return reads


def pairing_off(config, phase: str, reads: list[int]) -> str:
    """The head-pairing check's line for `phase` with the value heads reading `reads`: the first value
    head paired otherwise, the key head it read and the one its config names."""
    want = [config.key_head_of(j) for j in range(config.num_v_heads)]
    j = next(j for j in range(config.num_v_heads) if reads[j] != want[j])
    wrong = sum(r != w for r, w in zip(reads, want))
    return (re.escape(f"head pairing off at record/tp{TP}/seed{SEED}, {phase}: value head {j} read key head "
                      f"{reads[j]}, not key head {want[j]} ({config.head_pairing!r}: {HEAD_PAIRINGS[config.head_pairing]}); "
                      f"{wrong} of {config.num_v_heads} value heads read another key head"))


def split_as_the_other_pairing() -> str:
    """llama.cpp #21732's plant: both phases off, the reads those of a tiled split of a grouped layer."""
    reads = reads_on_ranks(NEXT_CONFIG, "tiled", "grouped")
    return pairing_off(NEXT_CONFIG, "prefill", reads) + r"[\s\S]*?" + pairing_off(NEXT_CONFIG, "decode step", reads)


def decode_indexing_modulo_h() -> str:
    """sglang #36722's plant: the prefill right (the first failing check is the decode step's pairing),
    the decode step reading key head j % H' of each rank's H' key heads."""
    reads = reads_on_ranks(CONFIG, "grouped", "tiled")
    return (rf"\Ahead pairing check failed for record/tp{TP}/seed{SEED}: \d+ failing check\(s\)\n\n"
            + pairing_off(CONFIG, "decode step", reads))


def process_wide_head_count() -> str:
    """DeepSpeed #8316's plant: the layer built first (the record's) off beside the second, right alone."""
    first, second = case_name(CONFIG), case_name(SECOND_CONFIG)
    return (re.escape(f"process-wide state: case {first} is off when the layers of {second} are built in the same "
                      f"rank processes (built, then run, in the order {first}, {second}), and right when built and "
                      f"run alone") + r"[^\n]*\n" + re.escape(f"parity failed for case {first}: "))
