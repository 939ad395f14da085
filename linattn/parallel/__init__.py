"""Process groups (`groups`), collectives as autograd functions (`mappings`), the hand-offs between
pipeline stages (`pipeline`) and, for context parallelism, the CP context and relayout (`cp`). A
group of None means no parallelism on that axis."""

from .groups import group_rank, group_size, new_groups, new_pipeline_group, parallel_rank_lists, pipeline_rank_lists

__all__ = ["group_rank", "group_size", "new_groups", "new_pipeline_group", "parallel_rank_lists", "pipeline_rank_lists"]
