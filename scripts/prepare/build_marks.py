"""Generated folders (the export, its weight variants) that are built again only when what they come from changed.

A folder is complete when its mark file holds the fingerprint of its inputs; the mark is written last, so a build
that stopped half-way is redone."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

EXPORT_MARK = "export_complete.json"
VARIANT_MARK = "quantize_complete.json"
EXPORT_FORMAT = 5  # bump when the exported graph changes, so that `make model` exports again


def up_to_date(output: Path, mark: str, fingerprint: dict) -> bool:
    done = output / mark
    return done.is_file() and json.loads(done.read_text()) == fingerprint


def start_fresh(output: Path) -> None:
    """An empty output folder: what a previous build left is removed."""
    if output.exists():
        shutil.rmtree(output)
    output.mkdir(parents=True)


def mark_complete(output: Path, mark: str, fingerprint: dict) -> None:
    (output / mark).write_text(json.dumps(fingerprint))


def source_fingerprint(source: Path) -> dict:
    """What an export's mark holds: its source file or folder (path, size, time) and the export's format."""
    stat = source.stat()
    return {"source": str(source.resolve()), "size": stat.st_size, "mtime": int(stat.st_mtime),
            "export_format": EXPORT_FORMAT}
