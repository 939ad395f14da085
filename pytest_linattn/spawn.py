"""The `spawn` fixture's callable: a call on several ranks (pytest_linattn.ranks.dispatch) with
pytest's outcomes: too few GPUs skips the test, a rank's failure fails it with every rank's
report, and under torchrun a failure that breaks the process group stops the session."""

from __future__ import annotations

import sys

import pytest

from .ranks import dispatch, pool
from .ranks.launcher import BrokenGroup


class Spawn:
    """``spawn(fn, world_size, *args, **kwargs)``: fn on every rank; values in rank order."""

    def __init__(self, launcher, pools, device: str, timeout: float, item=None):
        self._launcher, self._pools, self._device = launcher, pools, device
        self.timeout = timeout
        self._item = item

    def __call__(self, fn, world_size, *args, **kwargs):
        __tracebackhide__ = True
        try:
            return dispatch.run_on_ranks(fn, world_size, args, kwargs, device=self._device, timeout=self.timeout,
                                         pools=self._pools, launcher=self._launcher,
                                         fla_on_cpu=_active_fla_emulation(), test=getattr(self._item, "nodeid", ""))
        except pool.NotEnoughGpus as exc:
            pytest.skip(f"spawn(world_size={world_size}): {exc}")
        except pool.RankFailure as exc:
            if isinstance(exc, BrokenGroup) and self._launcher is not None and self._item is not None:
                # A collective was left half done: every later distributed test would fail or
                # hang on this group, so the session stops after this test, on every rank.
                self._item.session.shouldfail = (
                    f"linattn: the process group is broken after a failure in "
                    f"{self._item.nodeid}; the session stops (see that test's report)")
            # Re-raised here so the report ends at the test's call, not inside the pool.
            raise type(exc)(str(exc)) from None


def _active_fla_emulation():
    # The ranks run fla's ops emulated whenever the test process does (fixture, option or a
    # `with fla_on_cpu():` around spawn); sys.modules, so a run that never emulates imports nothing.
    emulation = sys.modules.get("linattn.emulation.patching")
    return None if emulation is None else emulation.active_compute_dtype()
