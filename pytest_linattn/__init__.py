"""pytest-linattn: the pytest plugin for distributed linear-attention parity tests.

Importing this package is cheap and imports neither pytest nor torch: ``pytest_linattn.ranks``,
``.harness``, ``.parity`` and friends work in plain Python. ``pytest -p pytest_linattn`` and
``pytest_plugins = ["pytest_linattn"]`` load the plugin through ``pytest_plugins`` below; the
installed entry point names this package too (pytest calls consider_module on every registered
module), so with ``-p pytest_linattn`` or ``-p pytest_linattn.plugin`` pytest finds the name taken
and never registers the plugin twice.
"""
from __future__ import annotations

pytest_plugins = ["pytest_linattn.plugin"]

__all__ = ["assert_parity", "Placement", "ShardedLayer", "ParityCase", "assert_sharded_parity", "assert_parity_cases",
           "TrainingStep", "assert_training_parity", "StatePath", "SequencePlan", "assert_continuation_parity",
           "StateInvisibleWarning"]

# name -> the plain module that defines it
_LAZY = {"assert_parity": "parity", **{n: "harness" for n in __all__[1:]}}


def __getattr__(name):
    # Lazy: parity and the harness import torch, which a plain `import pytest_linattn` should not pay for.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'pytest_linattn' has no attribute {name!r}")
