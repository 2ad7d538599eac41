"""Memory accounting per rank: parameters, gradients, optimizer state, saved activations, set-up peak.

``accounting`` counts tensors by unique storage and reads the process (resident set, CUDA allocator);
``saved`` counts what autograd saves for backward, composing with the package's own saved-tensor hooks;
``report`` makes the rows and the table; ``callback`` is ``MemoryReport``, which every strategy and
``lp-train`` use. See docs/memory.md.
"""

from lightning_parallel.memory.accounting import model_size, unique_storage_bytes
from lightning_parallel.memory.callback import MemoryReport, report_of
from lightning_parallel.memory.report import RankMemory, format_table, headline, measure_rank
from lightning_parallel.memory.saved import SavedTensorCounter, record_saved

__all__ = [
    "MemoryReport",
    "RankMemory",
    "SavedTensorCounter",
    "format_table",
    "headline",
    "measure_rank",
    "model_size",
    "record_saved",
    "report_of",
    "unique_storage_bytes",
]
