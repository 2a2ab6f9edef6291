"""Dataset statistics, streamed batch by batch (never the whole dataset in memory)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from assay.shards import iter_batches, read_manifest, require_documents

#: UTF-8 bytes per token of a byte-level BPE on English and code; an
#: approximation for sizing, not a tokenizer's count.
BYTES_PER_TOKEN = 4.0


def dataset_stats(directory: str | Path, batch_rows: int = 4096) -> dict[str, Any]:
    columns = ["text", "kind", "lang", "source"]
    require_documents(directory, columns)
    totals = {"documents": 0, "bytes": 0}
    groups: dict[str, dict[str, list[int]]] = {k: defaultdict(lambda: [0, 0]) for k in ("kind", "lang", "source")}
    for batch in iter_batches(directory, columns=columns, batch_size=batch_rows):
        table = pa.Table.from_batches([batch])
        table = table.append_column("bytes", pc.binary_length(table.column("text")))
        totals["documents"] += table.num_rows
        totals["bytes"] += pc.sum(table.column("bytes")).as_py() or 0
        for key in groups:
            grouped = table.group_by(key).aggregate([("bytes", "count"), ("bytes", "sum")])
            for value, n, size in zip(*(grouped.column(c).to_pylist() for c in (key, "bytes_count", "bytes_sum"))):
                groups[key][value][0] += n
                groups[key][value][1] += size or 0

    def rows(key: str) -> list[dict[str, Any]]:
        items = sorted(groups[key].items(), key=lambda kv: (-kv[1][1], kv[0]))
        return [{key: v, "documents": n, "bytes": b, "tokens": round(b / BYTES_PER_TOKEN)} for v, (n, b) in items]

    try:
        manifest = read_manifest(directory)
        quarantined = manifest.get("counts", {}).get("quarantined")
        made_by = manifest.get("installation")
    except Exception:
        quarantined = made_by = None
    return {
        "dataset": str(directory),
        "documents": totals["documents"],
        "bytes": totals["bytes"],
        "tokens": round(totals["bytes"] / BYTES_PER_TOKEN),
        "quarantined": quarantined,
        "made_by": made_by,  # assay.installation: the code and packages that wrote it
        "by_kind": rows("kind"),
        "by_lang": rows("lang"),
        "by_source": rows("source"),
    }
