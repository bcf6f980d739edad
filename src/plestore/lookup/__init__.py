"""Looking rows up: the user-facing `Table` over one tier, and what a lookup goes through.

ids -> table (validate, this rank's rows, pick a path) -> tier read -> hostpath (pinned
staging, H2D) -> gather_decode -> out;  pending: a lookup in flight;  staged: a fixed-shape
lookup a CUDA graph can capture;  metrics: per-phase counters.
"""

from plestore.lookup.pending import Pending
from plestore.lookup.table import Table, open_table

__all__ = ["Pending", "Table", "open_table"]
