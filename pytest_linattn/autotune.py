"""Kernel configs for parity runs: a correct kernel, the same one every run, with no config search.

A parity run needs a kernel that is right, not the fastest config; Triton's autotune compiles and
times every config of every kernel on a fresh machine (minutes) and lets bf16 results depend on
which config won that day. Modes (``--linattn-autotune``, env ``LINATTN_AUTOTUNE`` in the ranks):

    shipped  (default) fla's config cache reads the configs this package ships for the GPU
             (``fla_configs/<GPU name as fla sanitizes it>/<kernel>.json``): FLA_CACHE_MODE=full,
             i.e. exact key, then fuzzy key, then the file's default_config. Kernels that fla's
             cache does not cover (plain ``triton.autotune``) get the same lookup here. What is
             still without a config takes the first config (below).
    first    no shipped configs: every kernel takes the first config.
    search   Triton's autotune as it is.

"The first config" is the first of the kernel's configs that Triton's own pruning keeps
(``Autotuner.prune_configs``: the kernel's early_config_prune, then its perf model), never timed.
If it fails to compile for lack of resources (what Triton's autotune scores as infinitely slow),
the next one is taken. Kernels with a single config are left alone.

A user's own FLA_CACHE_MODE / FLA_CONFIG_DIR win over the shipped ones. Plain module: no pytest.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

__all__ = ["MODES", "ENV", "CONFIG_ROOT", "Plan", "plan", "apply", "restore", "apply_in_rank",
           "gpu_name", "sanitize_gpu_name", "shipped_config_dir", "patch_autotuner", "unpatch_autotuner",
           "autotuner_records", "kernel_config_files"]

MODES = ("shipped", "first", "search")
ENV = "LINATTN_AUTOTUNE"
# Set by suites/bench/dump_fla_configs.py: every rank writes its autotune results there on exit.
RECORDS_ENV = "LINATTN_AUTOTUNE_RECORDS"
CONFIG_ROOT = Path(__file__).resolve().parent / "fla_configs"
FLA_CACHE = "fla.ops.utils.cache"

logger = logging.getLogger(__name__)


def sanitize_gpu_name(name: str) -> str:
    """The GPU's name as fla names its config folder ("NVIDIA H200" -> "NVIDIA_H200")."""
    return re.sub(r"[^0-9A-Za-z]+", "_", name).strip("_") or "unknown_gpu"


def gpu_name(environ=None) -> str:
    """FLA_GPU_NAME, else device 0's name (what fla's get_gpu_info reads), sanitized."""
    environ = os.environ if environ is None else environ
    if "FLA_GPU_NAME" in environ:
        return sanitize_gpu_name(environ["FLA_GPU_NAME"])
    import torch

    return sanitize_gpu_name(torch.cuda.get_device_name(0)) if torch.cuda.is_available() else "cpu"


def shipped_config_dir(gpu: str, root: Path = CONFIG_ROOT) -> Path | None:
    """root/<gpu>/ when it holds at least one kernel's JSON, else None."""
    folder = Path(root) / gpu
    return folder if folder.is_dir() and any(folder.glob("*.json")) else None


@dataclass(frozen=True)
class Plan:
    """What a mode sets in a process: the fla variables (value, and whether the user set it) and
    whether the first-config fallback is patched into Triton."""
    mode: str
    gpu: str
    cache_mode: str | None
    cache_mode_is_users: bool
    config_dir: str | None
    config_dir_is_users: bool
    fallback: bool

    def describe(self) -> str:
        if self.mode == "search":
            return "linattn autotune: search (Triton's autotune)"

        def var(name, value, users):
            return f"{name}={value} ({'yours' if users else 'shipped'})" if value else f"{name} unset"

        dir_note = ""
        if self.mode == "shipped" and not self.config_dir:
            dir_note = f" (no shipped configs for {self.gpu})"
        return (f"linattn autotune: {self.mode}, no search; "
                f"{var('FLA_CACHE_MODE', self.cache_mode, self.cache_mode_is_users)}, "
                f"{var('FLA_CONFIG_DIR', self.config_dir, self.config_dir_is_users)}{dir_note}; "
                f"first-config fallback {'on' if self.fallback else 'off'}")


def plan(mode: str, *, environ=None, gpu: str | None = None, root: Path = CONFIG_ROOT) -> Plan:
    """What `apply(mode)` would set, without setting anything."""
    if mode not in MODES:
        raise ValueError(f"autotune mode: expected one of {', '.join(MODES)}, got {mode!r}")
    environ = os.environ if environ is None else environ
    cache_mode, config_dir = environ.get("FLA_CACHE_MODE"), environ.get("FLA_CONFIG_DIR")
    users_mode, users_dir = cache_mode is not None, config_dir is not None
    if mode == "search":
        return Plan(mode, gpu or "", cache_mode, users_mode, config_dir, users_dir, False)
    gpu = gpu or gpu_name(environ)
    if mode == "shipped" and not users_dir:
        shipped = shipped_config_dir(gpu, root)
        config_dir = str(shipped) if shipped else None
    if mode == "shipped" and not users_mode and config_dir:
        cache_mode = "full"  # exact key, then fuzzy, then the file's default_config
    return Plan(mode, gpu, cache_mode, users_mode, config_dir, users_dir, True)


# what apply() changed, for restore(): env names it set (with their old values) and the fla global
_APPLIED: dict = {}


def apply(mode: str, *, environ=None, gpu: str | None = None, root: Path = CONFIG_ROOT) -> Plan:
    """Set the mode's fla variables (never over a user's) and ``LINATTN_AUTOTUNE`` in environ, so
    the ranks a pool starts later inherit them, and patch Triton in this process. Idempotent;
    `restore()` undoes it. Logs the plan once per process."""
    environ = os.environ if environ is None else environ
    if _APPLIED:
        if _APPLIED["plan"].mode == mode:
            return _APPLIED["plan"]
        restore()
    p = plan(mode, environ=environ, gpu=gpu, root=root)
    old = {}
    wanted = {ENV: mode}
    if not p.cache_mode_is_users and p.cache_mode:
        wanted["FLA_CACHE_MODE"] = p.cache_mode
    if not p.config_dir_is_users and p.config_dir:
        wanted["FLA_CONFIG_DIR"] = p.config_dir
    for name, value in wanted.items():
        old[name] = environ.get(name)
        environ[name] = value
    _APPLIED.update(plan=p, environ=environ, old=old)
    # fla reads FLA_CACHE_MODE once, at import: an fla imported already gets the value set directly.
    cache = sys.modules.get(FLA_CACHE)
    if cache is not None and "FLA_CACHE_MODE" in wanted:
        _APPLIED["fla_mode"] = cache.FLA_CACHE_MODE
        cache.FLA_CACHE_MODE = cache.FlaCacheMode(p.cache_mode)
    if p.fallback:
        patch_autotuner()
    logger.info("%s", p.describe())
    return p


def restore() -> None:
    """Undo `apply`: the environment as it was, fla's mode as it was, Triton unpatched."""
    if not _APPLIED:
        return
    environ = _APPLIED["environ"]
    for name, value in _APPLIED["old"].items():
        if value is None:
            environ.pop(name, None)
        else:
            environ[name] = value
    cache = sys.modules.get(FLA_CACHE)
    if "fla_mode" in _APPLIED and cache is not None:
        cache.FLA_CACHE_MODE = _APPLIED["fla_mode"]
    unpatch_autotuner()
    _APPLIED.clear()


def apply_in_rank(device: str, environ=None) -> None:
    """In a pool's rank, before any kernel: the test process's mode (inherited through the
    environment with the fla variables), so the ranks pick what the test process picks."""
    environ = os.environ if environ is None else environ
    if device == "cuda" and environ.get(ENV) in ("shipped", "first"):
        patch_autotuner()
        logger.info("linattn autotune in rank: %s, first-config fallback on (FLA_CACHE_MODE=%s, "
                    "FLA_CONFIG_DIR=%s)", environ[ENV], environ.get("FLA_CACHE_MODE"),
                    environ.get("FLA_CONFIG_DIR"))


# ----------------------------------------------------------------------------------------------
# the Triton patch


def _autotuner_class():
    from triton.runtime.autotuner import Autotuner

    for name in ("run", "prune_configs"):
        if not callable(getattr(Autotuner, name, None)):
            raise RuntimeError(f"this Triton's Autotuner has no {name}(): the no-search fallback "
                               f"cannot be applied; use --linattn-autotune search")
    return Autotuner


def tuning_key(tuner, args, kwargs) -> tuple:
    """Triton's autotune cache key (the same in Triton 3.6 and 3.9, and in fla's AutotuneKey):
    the key arguments' values, then the dtype of every argument that has one."""
    named = {k: v for k, v in {**dict(zip(tuner.arg_names, args)), **kwargs}.items() if k in tuner.arg_names}
    key = [named[name] for name in tuner.keys if name in named]
    key += [str(v.dtype) for v in named.values() if hasattr(v, "dtype")]
    return tuple(key)


def kernel_name(tuner) -> str:
    """The kernel's function name: fla's config file name."""
    return tuner.base_fn.__name__


def config_fields(config) -> dict:
    """A triton.Config as fla's config files store it."""
    fields = {"kwargs": dict(config.kwargs), "num_warps": config.num_warps,
              "num_stages": config.num_stages, "num_ctas": getattr(config, "num_ctas", 1),
              "maxnreg": getattr(config, "maxnreg", None)}
    if getattr(config, "ir_override", None) is not None:
        fields["ir_override"] = config.ir_override
    return fields


def _same_config(fields: dict, config) -> bool:
    ours = config_fields(config)
    return all(fields.get(k, ours[k] if k in ("num_ctas", "maxnreg") else None) == ours[k] for k in ours)


def _shipped_choice(tuner, key, candidates):
    # fla's CachedAutotuner has looked already; a plain triton.autotune kernel asks fla's cache
    # here, and takes the config only when it is one the kernel offers for these arguments.
    cache = sys.modules.get(FLA_CACHE)
    if cache is None or isinstance(tuner, cache.CachedAutotuner):
        return None
    try:
        fields = cache.load_cached_config(kernel_name(tuner), cache.AutotuneKey(autotune_key=key))
    except (TypeError, ValueError):  # a key fla cannot hash
        return None
    if not isinstance(fields, dict):
        return None
    return next((c for c in candidates if _same_config(fields, c)), None)


def _resource_errors():
    from triton.runtime.errors import OutOfResources

    errors = [OutOfResources]
    try:
        from triton.runtime.errors import PTXASError

        errors.append(PTXASError)
    except ImportError:
        pass
    return tuple(errors)


def patch_autotuner() -> None:
    """Make every Triton Autotuner with more than one config take one without timing any (see
    the module doc). Idempotent; `unpatch_autotuner()` restores Triton's."""
    Autotuner = _autotuner_class()
    if getattr(Autotuner.run, "_linattn_no_search", False):
        return
    searching_run, searching_bench = Autotuner.run, Autotuner._bench
    resource_errors = _resource_errors()

    def run(self, *args, **kwargs):
        if len(self.configs) <= 1:
            return searching_run(self, *args, **kwargs)
        key = tuning_key(self, args, kwargs)
        if key in self.cache:  # fla's cache, or an earlier call, chose already
            return searching_run(self, *args, **kwargs)
        self.nargs = dict(zip(self.arg_names, args))  # prune_configs reads it
        candidates = list(self.prune_configs(kwargs)) or list(self.configs)
        shipped = _shipped_choice(self, key, candidates)
        if shipped is not None:
            candidates = [shipped] + [c for c in candidates if c is not shipped]
        for i, config in enumerate(candidates):
            self.cache[key] = config
            try:
                return searching_run(self, *args, **kwargs)
            except resource_errors:
                # it did not compile, so nothing ran: the next config
                self.cache.pop(key, None)
                if i == len(candidates) - 1:
                    raise

    def _bench(self, *args, config, **meta):
        # Only reached if Triton's run computes its key differently from tuning_key above.
        raise RuntimeError(f"linattn autotune: Triton was about to time configs of "
                           f"{kernel_name(self)}; this Triton's autotune key differs from the "
                           f"patch's. Run with --linattn-autotune search")

    run._linattn_no_search = True
    run.__wrapped__ = searching_run
    _bench.__wrapped__ = searching_bench
    Autotuner.run, Autotuner._bench = run, _bench


def unpatch_autotuner() -> None:
    try:
        from triton.runtime.autotuner import Autotuner
    except ImportError:
        return
    if getattr(Autotuner.run, "_linattn_no_search", False):
        Autotuner.run = Autotuner.run.__wrapped__
        Autotuner._bench = Autotuner._bench.__wrapped__


# ----------------------------------------------------------------------------------------------
# autotune results -> fla's config files (suites/bench/dump_fla_configs.py)


def autotuner_records(tuners) -> list[dict]:
    """Every (kernel, key, config) in the tuners' caches, as plain data; tuners with one config
    are skipped (nothing to choose)."""
    records = []
    for tuner in tuners:
        if len(getattr(tuner, "configs", ())) <= 1:
            continue
        for key, config in getattr(tuner, "cache", {}).items():
            records.append({"kernel": kernel_name(tuner), "key": list(key), "config": config_fields(config)})
    return records


def live_autotuners() -> list:
    """Every Triton Autotuner object of this process (fla's kernels are module-level)."""
    import gc
    import warnings

    from triton.runtime.autotuner import Autotuner

    with warnings.catch_warnings():  # isinstance on some lazy module attributes warns
        warnings.simplefilter("ignore")
        return [obj for obj in gc.get_objects() if isinstance(obj, Autotuner)]


def write_rank_records(directory: str) -> None:
    """This process's autotune results into directory/<pid>.json (dump_fla_configs merges them)."""
    path = Path(directory) / f"{os.getpid()}.json"
    path.write_text(json.dumps(autotuner_records(live_autotuners())))


def _key_hash(key) -> str:
    # fla's AutotuneKey.key_hash: md5 of compact, key-sorted JSON, tuples as lists
    return hashlib.md5(json.dumps(key, separators=(",", ":"), sort_keys=True).encode()).hexdigest()


def kernel_config_files(records: list[dict], triton_version: str) -> tuple[dict[str, dict], list[str]]:
    """fla's config files, {kernel name: file content}, from autotune records, and warnings.

    Each file: {"kernel_name", "triton_version", "autotune_entries": {key hash: {"autotune_key",
    "config"}}, "default_config"}; default_config is the config that won the most keys (ties:
    the first seen). Two records with one key but different configs (two kernels of one name):
    the first is kept, with a warning."""
    files: dict[str, dict] = {}
    warnings = []
    for rec in records:
        name = rec["kernel"]
        try:
            h = _key_hash(rec["key"])
        except TypeError:
            warnings.append(f"{name}: key {rec['key']!r} is not JSON; skipped")
            continue
        entries = files.setdefault(name, {"kernel_name": name, "triton_version": triton_version,
                                          "autotune_entries": {}, "default_config": None})["autotune_entries"]
        if h in entries and entries[h]["config"] != rec["config"]:
            warnings.append(f"{name}: key {rec['key']!r} has two winners; kept the first")
            continue
        entries[h] = {"autotune_key": rec["key"], "config": rec["config"]}
    for content in files.values():
        # counted by value; the config itself is kept as recorded (fla compares kwargs in order)
        by_value = {}
        for entry in content["autotune_entries"].values():
            by_value.setdefault(json.dumps(entry["config"], sort_keys=True), entry["config"])
        wins = Counter(json.dumps(e["config"], sort_keys=True) for e in content["autotune_entries"].values())
        if wins:
            content["default_config"] = by_value[wins.most_common(1)[0][0]]
    return files, warnings
