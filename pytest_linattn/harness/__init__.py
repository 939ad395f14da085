"""The layer-parity harness: a client's sharded layer (`ShardedLayer`) at TP / SP / CP placements
(`Placement`) against its replicated layer, one forward and backward (`assert_sharded_parity`,
`assert_parity_cases`). Plain modules, no pytest:

    placement            where a layer runs and which tokens each rank holds
    cases                what a client supplies (ShardedLayer, ParityCase)
    sharded_parity       the test process: the replicated run, gathering, the checks
    sharded_parity_rank  what each rank runs
"""

from .cases import ParityCase, ShardedLayer
from .placement import LAYOUTS, Placement, default_process_groups, rank_token_index
from .sharded_parity import assert_parity_cases, assert_sharded_parity

__all__ = ["LAYOUTS", "ParityCase", "Placement", "ShardedLayer", "assert_parity_cases", "assert_sharded_parity",
           "default_process_groups", "rank_token_index"]
