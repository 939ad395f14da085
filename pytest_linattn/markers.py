"""The plugin's markers: their table, and the skips the GPU markers make.

Plain Python: `skip_reason` says why a test cannot run here (or None); the plugin turns that into
a skip at the test's location.
"""
from __future__ import annotations

__all__ = ["MARKERS", "marker_count", "skip_reason"]

# One table: `pytest --markers` and the docs' reference read it.
MARKERS = (
    "world_size(n): the test runs n ranks; skipped on cuda with fewer than n GPUs (ceil(n / N) with "
    "--linattn-ranks-per-gpu N)",
    "gpus(n): skipped when the machine (or --linattn-device) has fewer than n GPUs (ceil(n / N) with "
    "--linattn-ranks-per-gpu N)",
    "suite(name): the test's home suite (suites/<name>), used by linattn-rerun",
    "tp_sizes(*sizes): the tensor-parallel sizes the test supports; others are deselected",
    "cp_sizes(*sizes): the context-parallel sizes the test supports; others are deselected",
)


def marker_count(marker) -> int:
    """The n of ``gpus(n)`` / ``world_size(n)``."""
    value = marker.args[0] if marker.args else marker.kwargs.get("n", 1)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"@pytest.mark.{marker.name}: n must be a non-negative int, got {value!r}")
    return value


def skip_reason(item, device: str, ranks_per_gpu: int) -> str | None:
    """Why ``item`` cannot run on this machine under its ``gpus`` / ``world_size`` markers, or None."""
    gpus = item.get_closest_marker("gpus")
    world = item.get_closest_marker("world_size")
    if gpus is None and world is None:
        return None
    if gpus is not None and device == "cpu":
        return f"needs {marker_count(gpus)} GPU(s); this run uses --linattn-device cpu"
    if device == "cpu":
        return None
    from .ranks.gpus import gpu_count, gpus_for

    have = gpu_count()
    shared = f" at {ranks_per_gpu} ranks per GPU" if ranks_per_gpu > 1 else ""
    # gpus(n) and world_size(n): n ranks, on n GPUs, or fewer where ranks share them
    if gpus is not None and have < gpus_for(marker_count(gpus), ranks_per_gpu):
        return (f"needs {gpus_for(marker_count(gpus), ranks_per_gpu)} GPU(s) (gpus({marker_count(gpus)}){shared}); "
                f"this machine has {have}")
    # world_size(n) needs GPUs only when the ranks run on GPUs (auto with none: CPU).
    if world is not None and (device == "cuda" or have > 0) and have < gpus_for(marker_count(world), ranks_per_gpu):
        return (f"needs {gpus_for(marker_count(world), ranks_per_gpu)} GPU(s) (world_size({marker_count(world)})"
                f"{shared}); this machine has {have}")
    return None
