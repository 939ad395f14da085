"""The process groups a rank's calls make: destroyed once nothing holds them.

Each distributed call (a pool's, pytest_linattn.ranks.worker; under torchrun,
pytest_linattn.ranks.launcher) makes its own groups. A gloo group holds three threads until it
is destroyed, so a long-lived rank would gather them call after call.
"""
from __future__ import annotations

import sys

__all__ = ["destroy_earlier_groups"]

# torch's records of its process groups (torch.distributed.distributed_c10d._world): the
# references to a group that are not its users'
_C10D_RECORDS = ("pg_map", "pg_names", "pg_group_ranks", "pg_backend_config", "pg_to_tag", "pg_coalesce_state",
                 "tags_to_pg")


def destroy_earlier_groups() -> None:
    """Destroy the process groups earlier calls made that nothing holds any more (each call
    makes its own; a test's cache of its groups keeps them). A gloo group holds three threads
    until it is destroyed: a pool's ranks gathered thousands over a session (collective mutants
    rerun a test's calls dozens of times), and their wake-ups slowed every rank. Run as a call
    starts: every rank has finished the call before (a rank that destroyed its groups as it
    returned could close a connection a slower peer still reads from)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    if not dist.is_initialized():
        return
    # only the records that are the same object at every read (a copy holds no reference)
    records = []
    for name in _C10D_RECORDS:
        record = getattr(c10d._world, name, None)
        if isinstance(record, dict) and record is getattr(c10d._world, name, None):
            records.append(record)
    world = c10d._get_default_group()
    for group in [g for g in list(c10d._world.pg_map) if g is not world]:
        # beyond torch's records: the list above, `group`, and getrefcount's argument
        if sys.getrefcount(group) - _references_in(records, group) > 3:
            continue  # held by the test's code
        try:
            dist.destroy_process_group(group)
        except Exception:
            pass  # already torn down (NCCL after an error): its threads are gone with it


def _references_in(records, group) -> int:
    count = 0
    for record in records:
        for key, value in record.items():
            count += (key is group) + (value is group)
            if isinstance(value, (list, tuple)):
                count += sum(item is group for item in value)
    return count
