"""Looking rows up: the user-facing `Table` over one tier, and what a lookup goes through.

ids -> table -> plan (plan.py's choose_plan: every decision — the route: device read | tier
read into staging | GPU row cache; where it runs; its stream — in one frozen Plan) -> executor
(carries the plan out: the route's body in routes.py) -> gather_decode -> out;  pending: a
lookup in flight;  staged: a fixed-shape lookup a CUDA graph can capture (its plan a staged_*
route);  staging: the pinned buffers tiers read into;  gpucache + gpudirectory: the GPU row
cache;  profile: its hot rows;  metrics: per-phase counters and one call's clock;  ranksum:
a rank's part of row-sharded rows, for the one float sum over the ranks;  context: what
these modules take from the table (one frozen TableContext, made as it opens).
"""

from plestore.lookup.pending import Pending
from plestore.lookup.table import Table, open_table

__all__ = ["Pending", "Table", "open_table"]
