"""Looking rows up: the user-facing `Table` over one tier, and what a lookup goes through.

ids -> table -> plan (validate; source: device read | staging | GPU row cache; where; stream)
-> executor (sources: the tier read into staging, the cache's hits and misses) ->
gather_decode -> out;  pending: a lookup in flight;  staged: a fixed-shape lookup a CUDA graph
can capture;  gpucache + gpudirectory: the GPU row cache;  profile: its hot rows;  metrics:
per-phase counters and one call's clock.
"""

from plestore.lookup.pending import Pending
from plestore.lookup.table import Table, open_table

__all__ = ["Pending", "Table", "open_table"]
