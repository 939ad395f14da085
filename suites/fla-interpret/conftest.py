"""The fla-interpret suite: the emulation (linattn.emulation.fla_on_cpu) against fla's own Triton
kernels under Triton's interpreter, float32, on a CPU.

suites.toml gives it ``--linattn-fla-interpreted on``: the plugin sets TRITON_INTERPRET=1 and
patches Triton at session start, before these tests import fla, and every test and every rank
spawn starts runs with fla's kernels interpreted. So it needs a pytest process of its own:
``pytest suites/fla-interpret`` (in a run that also collects suites/cpu, fla is imported compiled
first and every test here errors, saying so). Tests import fla inside functions only.
"""
import sys
from pathlib import Path

import pytest

# fidelity.py (the shared cases and checks) importable by name under any --import-mode
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.fixture(autouse=True)
def _fla_interpreted_here(fla_interpreted):
    """Every test here runs with fla's kernels interpreted, also when the option was turned off."""
    yield


def pytest_collection_finish(session):
    """Where a selected test spawns ranks: the rank server that imports fla (interpreted:
    TRITON_INTERPRET=1 is set by now) starts at once, importing while this process runs the first
    tests; the CP and state-path tests' ranks are forks of it (the server their pools would start,
    keyed by the same environment)."""
    import os

    from pytest_linattn.ranks import servers

    if (os.environ.get("TRITON_INTERPRET") == "1" and servers.can_preload_fla("cpu")
            and any("spawn" in getattr(item, "fixturenames", ()) for item in session.items)):
        servers.preloaded_server(servers.FLA_PRELOAD)
