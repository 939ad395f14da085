"""References kept across the reruns of one test.

Collective mutants rerun a test once per mutant (`recorder`); each rerun draws the same seeded
inputs and computes the same float64 reference in the test process, where no collective runs and
so no mutant reaches. While `keep_references()` is active (the recorder holds it around a test's
clean run and its reruns), `kept(key, compute)` computes once per key (`key()`, called only
then); outside it, every call computes. Code that computes references (the parity harness) calls
`kept` with keys that hold the digests of the tensors a reference reads, so a rerun that changed
them computes anew.
"""
from __future__ import annotations

from contextlib import contextmanager

__all__ = ["keep_references", "kept"]

_KEPT: dict | None = None


@contextmanager
def keep_references():
    """Keep references for the length of the block (nested blocks share the outer one's)."""
    global _KEPT
    outer = _KEPT
    _KEPT = {} if outer is None else outer
    try:
        yield
    finally:
        _KEPT = outer


def kept(key, compute):
    """compute(), once per key() while references are kept; every call otherwise."""
    if _KEPT is None:
        return compute()
    key = key()
    if key not in _KEPT:
        _KEPT[key] = compute()
    return _KEPT[key]
