"""The Batch API's limits and where its state lives (docs/api.md#files-and-batches-the-batch-api)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

DATA_DIR_ENV = "TRITON_LLM_BATCH_DIR"  # the container sets it to a writable volume
DEFAULT_DATA_DIR = Path("build/batches")  # relative to the project root; `make clean` keeps it


@dataclass(frozen=True)
class BatchConfig:
    data_dir: Path = DEFAULT_DATA_DIR  # the SQLite database and the files directory
    max_file_bytes: int = 64 << 20  # an uploaded file (413 beyond)
    max_line_bytes: int = 1 << 20  # a line of a batch input file (that line fails; the rest runs)
    max_lines: int = 50_000  # lines of one batch (400 at batches.create beyond)
    max_active_batches: int = 8  # batches validating, in progress or finalizing at once (429 beyond)
    concurrency: int = 30  # lines in flight, all batches together: max_batch_size 32 - priority_reserved_slots 2
    line_priority: int = 1  # a line's priority when its body gives none above 0 (live requests have 0)
    retention_days: int = 30  # ended batches, their results and uploaded files are deleted after this
    completion_window_s: int = 24 * 3600  # "24h", OpenAI's only window
