"""The session's resources: rank pools, the torchrun launcher, the autotune plan.

One object per pytest session (the plugin keeps it in ``config.stash``); it starts each resource
the first time a test needs it and ends them all at the session's end.
"""
from __future__ import annotations

import os

__all__ = ["SessionResources"]


class SessionResources:
    """The session's resources: rank pools, the torchrun launcher, the autotune plan."""

    def __init__(self, config, read_option):
        self.config = config
        self.read_option = read_option  # (config, key) -> the option's value, read now
        self.manager = None
        self.is_worker = hasattr(config, "workerinput")
        self.autotune = None  # the applied pytest_linattn.autotune plan; None until session start
        self.launcher = None  # pytest_linattn.launcher.LauncherSession under torchrun
        self.size_notes = []  # lines for the terminal summary: sizes asked for but not run

    def pools(self):
        if self.manager is None:
            from .ranks.pool import PoolManager

            self.manager = PoolManager(self.read_option(self.config, "device"),
                                       ranks_per_gpu=self.read_option(self.config, "ranks_per_gpu"))
        return self.manager

    def close(self):
        if self.launcher is not None:
            # Rank 0's report goes into the stream first: once it says it is over the other ranks
            # exit, and torchrun logs into the same stream (and stops rank 0) from then on.
            if self.config.pluginmanager.get_plugin("terminalreporter") is not None:
                self.config.get_terminal_writer().flush()
            self.launcher.finish()
            if self.launcher.terminal_fd is not None:
                os.close(self.launcher.terminal_fd)
            self.launcher = None
        if self.manager is not None:
            self.manager.close()
            self.manager = None
        if self.autotune is not None:
            from . import autotune

            self.write_autotune_records()
            autotune.restore()
            self.autotune = None

    def write_autotune_records(self):
        """An xdist worker's autotune results, for suites/bench/dump_fla_configs.py: after every
        test (a dump cut at its time limit kills the workers before their session closes)."""
        from . import autotune

        if self.autotune is not None and self.is_worker and os.environ.get(autotune.RECORDS_ENV):
            autotune.write_rank_records(os.environ[autotune.RECORDS_ENV])

    def apply_autotune(self):
        """On CUDA, before any kernel and any pool: the autotune mode, in this process and (through
        the environment) in every rank. Once per session; None on a CPU run."""
        if self.autotune is None and self.runs_on_cuda():
            from . import autotune

            self.autotune = autotune.apply(self.read_option(self.config, "autotune"))
        return self.autotune

    def runs_on_cuda(self):
        from .ranks.pool import resolve_device  # auto: cuda when a GPU is visible

        return resolve_device(self.read_option(self.config, "device")) == "cuda"
