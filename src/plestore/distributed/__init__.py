"""Tables over a torch.distributed group: `open_sharded` (rows: vocab-parallel, all-reduce;
heads: hash columns, all-gather), bit-identical on every rank to one process's lookup."""

from plestore.distributed.agree import GroupDisagrees
from plestore.distributed.partition import ShardPlan, head_columns, plan_shard, vocab_range
from plestore.distributed.sharded import ShardedPending, ShardedTable, open_sharded
from plestore.distributed.staged import ShardedStaged

__all__ = [
    "GroupDisagrees",
    "ShardPlan",
    "ShardedPending",
    "ShardedStaged",
    "ShardedTable",
    "head_columns",
    "open_sharded",
    "plan_shard",
    "vocab_range",
]
