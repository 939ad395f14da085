"""Where each plant's report must point: the located patterns of the bug record's entries
(`registry.Bug.located`), each a regex over its check's report (a line naming the tensor and the
sequence, token, head, call or rank where it is off). Derived from the record's sizes
(`bug_record.checks`) and the plants' own constants, never read off a report: a check that fails
for another reason than the plant's does not count as a catch.
"""

from __future__ import annotations

import re
import types

import torch

from bug_record import checks
from bug_record import plants_handoff as H
from bug_record import plants_state as S
from bug_record.checks import CONFIG, REPLICATED_CONFIG
from bug_record.checks_pipeline import PIPELINE, PIPELINE_LAYERS
from linattn.layers import LayerState
from pytest_linattn.harness.continuation_plans import describe_token, plan_cuts
from pytest_linattn.harness.pipeline import decode_counts, stage_layers
from pytest_linattn.harness.pipeline_report import stage_words
from pytest_linattn.harness.serving_plans import pool_schedule, snapshots_of


FIRST_BACKWARD = (r"first call whose backward is wrong [^:]*: sequence \d+ \(chunks [\d+]+(, then \d decode steps)?\), "
                  r"(chunk|decode step) \d of \d \([^)]*\)(, token \d+)?")




def parity_row(name, where):
    """A failing tensor's row in an assert_parity table: its name, error, rtol, max|diff| and the
    worst element's location (`where`, a regex)."""
    return re.escape(name) + r"\s+\S+\s+\S+\s+\S+\s+" + where


TOKEN = r"seq \d+ token \d+ \(global \d+\)"
POOL_CALL = r"call \d+ \((decode|prefill) of sequences \[[\d, ]+\] in slots \[[\d, ]+\][^)]*\)"
# a padding row's write to live slot 0 (the call, the slot, its sequence), then the first token it spoils
POOL_SLOT_0 = (POOL_CALL + r" changed live slot 0 \(sequence \d+, [^)]*\), which it did not schedule: field \w+"
               r"[\s\S]*?first wrong token: sequence \d+ \([^)]*\) token \d+, " + POOL_CALL + r", its slot 0")
PREFIX_CALL = (r"call \d+ \(prefill of sequences \[[\d, ]+\] in slots \[[\d, ]+\](, snapshots to slots \[[-\d, ]+\])?"
               r"(, from prefix slots \[[-\d, ]+\])?\)")
# a prefix hit's call writing the block it read from
PREFIX_BLOCK_WRITTEN = (PREFIX_CALL + r" changed prefix block slot \d+ \(the snapshot of sequence \d+ at token \d+\), "
                        r"which it read from: field conv, max \|change\| \S+ \(rank \d\)")
# a snapshot slot left as it was: not the state at its block boundary, from the first snapshot (the
# first sequence's, at the first block boundary: bug_record.checks.PREFIX_PLANS, PREFIX_BLOCK)
SNAPSHOT_WRONG = (PREFIX_CALL + r": the snapshot of sequence 0 \([^)]*\) at token " + str(checks.PREFIX_BLOCK)
                  + r" in slot \d+ is not the state there: field \w+ error \S+; it holds the slot's contents from "
                  r"before \(never written\)")
# a snapshot copied in part (an element count read as bytes): the first snapshot, each field's first
# numel / element_size elements the state's (float64 ranks: 1 in 8)
SNAPSHOT_PARTIAL = (PREFIX_CALL + r": the snapshot of sequence 0 \([^)]*\) at token " + str(checks.PREFIX_BLOCK)
                    + r" in slot \d+ is not the state there: field \w+ error \S+; it holds a partial copy: "
                    r"(\d+) of (\d+) elements the state's, the rest the slot's contents from before")
# a verify call's slot left holding a state past its accepted drafts
SPEC_STATE = (r"call \d+ \(verify round \d+: 3 drafts each of sequences \[[\d, ]+\] in slots \[[\d, ]+\], accepted "
              r"\[[\d, ]+\]\): slot \d+, sequence \d+ \([^)]*\), state after token \d+, [012] of 3 drafts accepted: "
              r"field \w+ error \S+")


def undrafted_after_accepting(plans=checks.SPEC_MIXED_PLANS, K=checks.SPEC_MIXED_DRAFTS):
    """vLLM #56531's plant: the first verify round where a sequence drafts nothing after a round that
    accepted a draft (its state past column 0): that call's line for the sequence's bonus token."""
    r, n = min((r, n) for n, pl in enumerate(plans) for r in range(1, len(pl.accepted))
               if pl.drafts_of(r, K) == 0 and pl.accepted[r - 1] > 0)
    seqs = [m for m, pl in enumerate(plans) if r < len(pl.accepted)]
    call = max(len(pl.chunks) for pl in plans) + r
    token = sum(plans[n].chunks) + sum(1 + j for j in plans[n].accepted[:r])
    drafts = [plans[m].drafts_of(r, K) for m in seqs]
    return (re.escape(f"call {call} (verify round {r + 1}: the next token and drafts {drafts} (mixed) of sequences "
                      f"{seqs} in slots ") + r".*?" + re.escape(f", accepted {[plans[m].accepted[r] for m in seqs]}): ")
            + r"slot \([\d, ]+\), " + re.escape(f"sequence {n} ({plans[n]}), token {token}: output error"))


def conv_window_of_rejected_drafts(plans=checks.SPEC_MIXED_PLANS, K=checks.SPEC_MIXED_DRAFTS):
    """vLLM #50272's plant: the first sequence of the first verify round that rejects a draft; its
    conv state after the call (the slot it continues from) holds the rejected drafts."""
    r, n = min((r, n) for n, pl in enumerate(plans) for r in range(len(pl.accepted))
               if pl.accepted[r] < pl.drafts_of(r, K))
    call = max(len(pl.chunks) for pl in plans) + r
    start = sum(plans[n].chunks) + sum(1 + j for j in plans[n].accepted[:r])
    j, d = plans[n].accepted[r], plans[n].drafts_of(r, K)
    return (re.escape(f"call {call} (verify round {r + 1}: ") + r"[^\n]*?" + r"slot \([\d, ]+\), "
            + re.escape(f"sequence {n} ({plans[n]}), state after token {start + j}, {j} of {d} drafts accepted: "
                        f"field conv error"))


def handed_off(plant, source, target, tp_rank, field="conv", config=REPLICATED_CONFIG, cu=checks.STATE_CU):
    """The state handoff check's line for the plant's state handed to `target`'s rank `tp_rank`
    (sequence 0, the first wrong), its region derived from the plant (plants_handoff.wrong_region)."""
    region = H.wrong_region(config, plant, source, target, tp_rank, field)
    return (re.escape(f"handed-off state at tp{target.tp}, tp_rank {tp_rank}, sequence 0 (a {int(cu[1])}-token "
                      f"prompt), field {field}: error ") + r"\S+" + re.escape(f"; wrong in {region}") + r"(?=[ ,;])")




def hit_from_an_empty_state(plans=checks.PREFIX_PLANS, hits=checks.PREFIX_HITS):
    """vLLM #43090's plant: the snapshots of the sequence hit (written before any hit) stay right, no
    prefix block changes, and the outputs go wrong from the first prefix hit's first computed token,
    in the call that ran its first chunk (a hit that snapshots later snapshots its wrong state)."""
    n = min(hits)
    source, tokens = hits[n]
    return (rf"\A(?![\s\S]*the snapshot of sequence {source} \()(?![\s\S]*changed prefix block)[\s\S]*?"
            + re.escape(f"first wrong token: sequence {n} ({plans[n]}) token {tokens}, call ") + r"\d+ "
            + PREFIX_CALL[len(r"call \d+ "):])




def captured_destination_tail():
    """sglang #32555's plant: every prefill right; a decode call's own outputs right (each row reads
    its slot), its states written to the null slot: the first wrong token is a sequence's second
    decode step, in a decode call."""
    return (r"first wrong token: sequence \d+ \([^)]*, then \d+ decode steps\) token \d+, call \d+ \(decode of "
            r"sequences \[[\d, ]+\] in slots \[[\d, ]+\], padded to \d+ rows?( with padding rows at slots "
            r"\[[\d, ]*\])?\)")


# a row whose pads straddle into a continued call: its state after that call is off, then its first token
PADDED_STATE = (r"call [12] \(prefill of columns \d+\.\.\d+, pads per row \[[\d, ]+\]\): row \d \(a \d-token prompt\), "
                r"state before its first token \(zeros\): field \w+ error \S+")


# ---- derived from the record's sizes -----------------------------------------------------------


def at_token(t, cu=checks.CU):
    """How a parity report names global token `t` of the packed batch `cu`: 'seq n token i (global t)'."""
    n = max(i for i in range(len(cu) - 1) if cu[i] <= t)
    return f"seq {n} token {t - cu[n]} (global {t})"


def first_wrong_per_rank(case, *per_rank):
    """A CP case's output row, then its first wrong token on CP rank 0, 1, ...: `per_rank[r]` the
    words for rank r (`at_token(t)`, or "none": the rank's outputs are right)."""
    said = "; ".join(f"CP rank {r} at {where}" for r, where in enumerate(per_rank))
    return parity_row(f"{case} output", r"[^\n]*") + r"\n" + re.escape(f"first wrong token per rank: {said}")


# the continuation check's cuts of the record's sequences (as assert_continuation_parity makes them)
STATE_PLANS = plan_cuts([int(n) for n in checks.STATE_SEQLENS], conv_width=CONFIG.conv_size,
                        chunk_size=checks.CUT_CHUNK, seed=checks.SEED)


def prefill_chunks():
    """(sequence, chunk index, first token, size, offset in its packed call) of every prefill chunk:
    call k packs chunk k of every sequence that has one, in sequence order."""
    chunks = []
    for k in range(max(len(plan.chunks) for plan in STATE_PLANS)):
        offset = 0
        for n, plan in enumerate(STATE_PLANS):
            if k < len(plan.chunks):
                chunks.append((n, k, sum(plan.chunks[:k]), plan.chunks[k], offset))
                offset += plan.chunks[k]
    return chunks


def first_wrong_in_prefill(wrong_from):
    """The continuation report's first-wrong-token line for a prefill plant that puts a chunk wrong
    from its position `wrong_from(size, offset)` on (`offset`: the chunk's place in its packed
    call; None: the chunk stays right): the first wrong token (earliest position, lowest sequence
    on a tie), the chunk that ran it, and the sequences with a wrong token."""
    firsts = {}
    for n, k, start, size, offset in prefill_chunks():
        at = wrong_from(size, offset)
        if at is not None and (n not in firsts or start + at < firsts[n][0]):
            firsts[n] = (start + at, k)
    n = min(firsts, key=lambda m: (firsts[m][0], m))
    position, k = firsts[n]
    where = describe_token(types.SimpleNamespace(kind="prefill", index=k), position, STATE_PLANS[n])
    return (re.escape(f"first wrong token: sequence {n} ({STATE_PLANS[n]}), {where}, error ") + r"\S+"
            + re.escape(f" of the tokens' RMS norm; sequences with a wrong token: {sorted(firsts)}") + r"(?=\n|\Z)")


def first_wrong_in_decode():
    """The same line for a plant on the decode step alone: decode step 1 of the sequence whose prefill
    is shortest, every decoding sequence wrong, every prefill chunk right."""
    prefill = [sum(plan.chunks) for plan in STATE_PLANS]
    n = prefill.index(min(prefill))
    where = describe_token(types.SimpleNamespace(kind="decode", index=0), prefill[n], STATE_PLANS[n])
    decoding = [m for m, plan in enumerate(STATE_PLANS) if plan.decode]
    return re.escape(f"first wrong token: sequence {n} ({STATE_PLANS[n]}), {where}, error ") + r"\S+" + re.escape(
        f" of the tokens' RMS norm; sequences with a wrong token: {decoding}; only decode steps hold a wrong "
        "token: every prefill chunk is right")


def final_state_off(field, *, count=1):
    """The continuation report's final-state table with `count` of LayerState's fields off, `field`
    the first of them."""
    return (rf"final state: {count} of {len(LayerState._fields)} tensor\(s\) off[^\n]*\n[^\n]*"
            rf"\n\s+{field}\s[^\n]*")


def even_split_of_in_proj_qkv(config, tp):
    """Megatron PR #1989's split, [Q_all | K_all | V_all].chunk(tp), against the per-section one:
    they agree on TP rank 0's q rows (the start of both) and the last rank's v rows (the end of
    both), nowhere else. (first wrong row, last wrong row, rows, its key head)."""
    q, v = config.num_k_heads * config.head_k_dim, config.num_v_heads * config.head_v_dim
    total = 2 * q + v
    return q // tp, total - v // tp - 1, total, config.num_k_heads // tp


def shard_note_of_even_split():
    first, last, total, key_head = even_split_of_in_proj_qkv(CONFIG, 2)
    return re.escape(f"shard and unshard disagree: unshard of the TP ranks' shards is not the reference's weight in "
                     f"in_proj_qkv.weight (rows {first}..{last} of {total} differ; first: q: key head {key_head}, "
                     f"channel 0, col 0 (TP rank 1) at index ({first}, 0)). Each rank")


def first_boundary_lost_by_division(cu=checks.CU, cp=2):
    """Megatron dev 098d7d97: each rank's local boundaries taken as cu_seqlens // cp. On CP rank 0
    the first true boundary that is not among them is where a sequence runs on from the one
    before: its token 0 is the first wrong."""
    divided = {b // cp for b in cu}
    return next(b for b in cu[1:] if b < cu[-1] // cp and b not in divided)


def first_padded_sequence(cu=checks.CU, cp=2):
    """Megatron #4495's class: the first sequence whose padded start (each sequence padded to a
    multiple of 2 * cp) differs from its unpadded one; its run begins in the pads before it."""
    lengths = [b - a for a, b in zip(cu[:-1], cu[1:])]
    padded = [0]
    for n in lengths:
        padded.append(padded[-1] - (-n // (2 * cp)) * (2 * cp))
    return next(i for i in range(len(cu) - 1) if padded[i] != cu[i])


def stale_packing_micro_batches(packings=checks.TRAINING_PACKINGS):
    """miles #2213's plant keys the packing by token count: a micro-batch whose count an earlier
    one had, with another packing, runs on the earlier one's boundaries. (those, the others), 1-based."""
    stale = [m for m, cu in enumerate(packings)
             if any(cu[-1] == old[-1] and cu != old for old in packings[:m])]
    return [m + 1 for m in stale], [m + 1 for m in range(len(packings)) if m not in stale]


def loss_by_micro_batch_of_stale_packing():
    stale, right = stale_packing_micro_batches()
    m = stale[0]
    return (re.escape(f"record/tp2/seed44 step 1/2 ({len(checks.TRAINING_PACKINGS)} micro-batches) loss by "
                      f"micro-batch: micro-batch {m} of {len(checks.TRAINING_PACKINGS)} is the first off (cu_seqlens "
                      f"{checks.TRAINING_PACKINGS[m - 1]}): ")
            + r"\S+, the reference's \S+ \(relative error \S+\); "
            + re.escape(f"off: micro-batches {stale}; right: {right}"))


def replay_on_moved_state():
    """Automodel #3247's class: the forward runs once on the state as it was (the output bitwise
    equal), the replay on the state the forward moved: the input gradient and every parameter
    gradient differ, on every rank."""
    grads = [f"grad {n}" for n, _ in checks.reference().named_parameters()]
    return re.escape(f"on rank 0 (TP rank 0, CP rank 0), {1 + len(grads)} of {2 + len(grads)} tensors are not bitwise "
                     f"equal to the same run without recompute: dx, {', '.join(grads)}; bitwise equal: output (")


def halo_gradient_leak(cu=checks.CU_SHORT, cp=4, W=CONFIG.conv_size):
    """fla #774's plant at cp-short: the tokens the unmasked halo gradient reaches, each a token of
    the sequence before a piece's first one, among the W-1 before the piece: {CP rank holding it:
    the token}. The first failing check is dx (the output, checked first, is right)."""
    local = int(cu[-1]) // cp
    leaks = {}
    for r in range(1, cp):
        start = r * local
        first = max(b for b in cu if b <= start)  # where the piece's first sequence starts
        for t in range(max(0, start - (W - 1)), first):
            leaks.setdefault(t // local, t)
    case = f"record/cp{cp}-contiguous/seed44"
    said = "; ".join(f"CP rank {r} at " + (at_token(leaks[r], cu) if r in leaks else "none") for r in range(cp))
    rank, t = min(leaks.items())
    return (r"(?<=failing check\(s\)\n\n)" + re.escape(f"parity failed for {case} dx: ") + r"[^\n]*\n[^\n]*\n\s+"
            + parity_row(f"{case} dx", re.escape(f"{at_token(t, cu)} on CP rank {rank}")) + r"[^\n]*\n"
            + re.escape(f"first wrong token per rank: {said}"))


def loss_without_token_count(packings=checks.TRAINING_PACKINGS):
    """verl #6609's plant at training-cp: each micro-batch's loss, the loss and the gradients come out
    x its token count (the division skipped); the first step's loss by micro-batch and grad norm."""
    tokens = {int(cu[-1]) for cu in packings}
    assert len(tokens) == 1, "the record's micro-batches share one length"
    error, M = re.escape(f"(relative error {tokens.pop() - 1:.2e})"), len(packings)
    label = f"step 1/2 ({M} micro-batches)"
    return (re.escape(f"{label} loss by micro-batch: micro-batch 1 of {M} is the first off (cu_seqlens "
                      f"{[int(b) for b in packings[0]]}): ") + r"\S+, the reference's \S+ " + error
            + re.escape(f"; off: micro-batches {list(range(1, M + 1))}; right: none") + r"[\s\S]*?"
            + re.escape(f"{label} grad norm: the reference's is ") + r"\S+ \(rtol 1e-10\); "
            + re.escape("off on 2 of 2 rank(s):") + r"\n\s+" + re.escape("TP rank 0, CP rank 0: ") + r"\S+ " + error)


# ---- inner snapshots (the state-pool-inner check) ---------------------------------------------------

INNER_CALL = (r"call \d+ \(prefill of sequences \[[\d, ]+\] in slots \[[\d, ]+\](, snapshots to slots \[[-\d, ]+\])?"
              r"(, inner snapshots to slots \[[\[\]\-\d, ]+\])?(, from prefix slots \[[-\d, ]+\])?\)")


def inner_snapshot_slot(n, t, plans=checks.INNER_PLANS, hits=checks.INNER_HITS, block=checks.INNER_BLOCK,
                        cu=checks.INNER_CU, max_live=2):
    """The slot of sequence n's snapshot at token t in the spare pool (max_live + 1 slots: the
    report's first pool), from the check's own schedule."""
    bounds = [int(b) for b in cu]
    calls = pool_schedule(plans, bounds, max_live, max_live + 1, CONFIG.hidden_size, torch.Generator(),
                          checks.POOL_CAPTURE_SIZES, block, hits, inner_snapshots=True)
    return next(s for c in calls if c.kind == "prefill" for seq, s, u in snapshots_of(c, bounds) if (seq, u) == (n, t))


def inner_snapshot_wrong(n, t, holds, plans=checks.INNER_PLANS, hits=checks.INNER_HITS):
    """The snapshot line of sequence n's inner snapshot at token t (what its slot holds), then the
    first wrong token: the first prefix hit from that snapshot, at its first computed token."""
    h = min(h for h, source in hits.items() if source == (n, t))
    return (INNER_CALL + re.escape(f": the snapshot of sequence {n} ({plans[n]}) at token {t}, inside its ")
            + r"\d+-token chunk from token \d+, "
            + re.escape(f"in slot {inner_snapshot_slot(n, t)} is not the state there: field ") + r"\w+ error \S+"
            + re.escape(f"; it holds {holds}") + r"[\s\S]*?"
            + re.escape(f"first wrong token: sequence {h} ({plans[h]}) token {t}, call ") + r"\d+ ")


def inner_snapshot_stale(plans=checks.INNER_PLANS, hits=checks.INNER_HITS, block=checks.INNER_BLOCK):
    """sglang #30938's plant: the first inner snapshot a short chunk leaves unwritten."""
    n, t = S.stale_inner_snapshots(plans, hits, block)[0]
    return inner_snapshot_wrong(n, t, "the slot's contents from before (never written)", plans, hits)


def inner_snapshot_misplaced(plans=checks.INNER_PLANS, hits=checks.INNER_HITS, block=checks.INNER_BLOCK):
    """vLLM #51113's plant: the first inner snapshot holding its chunk's end state."""
    n, t, end = S.misplaced_inner_snapshots(plans, hits, block)[0]
    return inner_snapshot_wrong(n, t, f"the state at token {end} (its chunk's end)", plans, hits)


def first_wrong_of_a_flat_context(cu=checks.CU_ZIGZAG, cp=2):
    """Megatron #3282's plant at cp-zigzag: the layer computes the tokens a rank holds (per-sequence
    zigzag) as the flat positions [r * T/cp, ...) it believes it holds; a held token is right only
    if every position from its flat sequence's start to it holds the token of that position. Per CP
    rank, its first wrong token in global order (or "none")."""
    from pytest_linattn.harness import Placement
    from pytest_linattn.harness.placement import rank_token_index

    total, local = cu[-1], cu[-1] // cp
    held = [rank_token_index(cu, Placement(cp=cp, cp_layout="zigzag"), cp_rank=r).tolist() for r in range(cp)]
    token_at = [held[f // local][f % local] for f in range(total)]  # flat position -> the token held there

    def right(f):
        start = max(b for b in cu if b <= f)
        return all(token_at[u] == u for u in range(start, f + 1))

    per_rank = []
    for r in range(cp):
        wrong = [token_at[f] for f in range(r * local, (r + 1) * local) if not right(f)]
        per_rank.append(at_token(min(wrong), cu) if wrong else "none")
    return first_wrong_per_rank(f"record/cp{cp}-zigzag/seed44", *per_rank)


def _pipeline_steps(seqlens=checks.STATE_SEQLENS):
    """The pp-decode check's decode steps: (sequences, each one's decoded token) per step, the
    harness's default decode counts over `seqlens`."""
    counts = decode_counts(len(seqlens))
    return [[(n, length - d + j) for n, (length, d) in enumerate(zip(seqlens, counts)) if j < d]
            for j in range(max(counts))]


def _pipeline_stage(stage):
    return stage_words(stage, stage_layers(PIPELINE_LAYERS, PIPELINE.pp, stage))


def _decode_step(j, steps):
    return f"decode step {j + 1} of {len(steps)} (sequences {[n for n, _ in steps[j]]})"


def caches_looked_up_by_stage_index(seqlens=checks.STATE_SEQLENS):
    """sglang #39699's plant: every output right up to the first decode step on stage 1, whose
    layers find no cache (they read stage-local entries, never written there); then stage 1's
    first layer's cache off for every sequence."""
    steps = _pipeline_steps(seqlens)
    stage = _pipeline_stage(1)
    return (re.escape(f"first wrong output: {_decode_step(0, steps)} on {stage}; the calls before it right on every "
                      f"stage, this one right on stage 0") + r"[\s\S]*?"
            + re.escape(f"record/pp2/seed44 {stage} layer 2 cache: ") + r"[\s\S]*?"
            + re.escape(f"sequences off: {list(range(len(seqlens)))}; right: none"))


def stale_row_map(seqlens=checks.STATE_SEQLENS):
    """vLLM-backport #63's plant: the first decode step whose rows hold other sequences than the
    step before's is the first wrong call, on stage 0 (a non-last stage), wrong at the first row
    that moved (it reads and writes the slot of the sequence that held the row before); stage 0's
    first layer's cache then off for that sequence and the one whose slot it used."""
    steps = _pipeline_steps(seqlens)
    j = next(j for j in range(1, len(steps))
             if [n for n, _ in steps[j]] != [n for n, _ in steps[j - 1]][:len(steps[j])])
    r = next(r for r, (n, _) in enumerate(steps[j]) if n != steps[j - 1][r][0])
    moved, token = steps[j][r]
    owner = steps[j - 1][r][0]
    stage = _pipeline_stage(0)
    return (re.escape(f"first wrong output: {_decode_step(j, steps)} on {stage}; the calls before it right on every "
                      f"stage") + r"\n[\s\S]*?"
            + re.escape(f"rows off: row {r} (sequence {moved}, token {token})") + r"[\s\S]*?"
            + re.escape(f"record/pp2/seed44 {stage} layer 0 cache: ") + r"[\s\S]*?"
            + re.escape(f"sequences off: {sorted({owner, moved})}"))
