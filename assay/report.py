"""Human-readable tables for summaries, stats and lineage (rich), printed to stdout."""

from __future__ import annotations

import json
from typing import Any

from rich.console import Console
from rich.table import Table

console = Console()


def _size(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def ingest_summary(manifest: dict[str, Any]) -> None:
    counts, timings = manifest["counts"], manifest.get("timings", {})
    table = Table(title=f"ingest: {len(manifest.get('shards', []))} shard(s)", show_header=True)
    table.add_column("what")
    table.add_column("count", justify="right")
    table.add_row("input records", f"{counts['input_records']:,}")
    table.add_row("documents kept", f"{counts['documents']:,}")
    for kind, n in counts.get("by_kind", {}).items():
        table.add_row(f"  kind={kind}", f"{n:,}")
    table.add_row("quarantined", f"{counts['quarantined']:,}")
    for reason, n in counts.get("by_reason", {}).items():
        table.add_row(f"  {reason}", f"{n:,}")
    for what, n in counts.get("skipped", {}).items():
        table.add_row(f"skipped: {what}", f"{n:,}")
    table.add_row("bytes in / out", f"{_size(counts['bytes_in'])} / {_size(counts['bytes_out'])}")
    if timings.get("seconds"):
        table.add_row("time", f"{timings['seconds']:.1f} s ({timings.get('docs_per_second')} docs/s, {timings.get('mb_per_second')} MB/s)")
    if counts.get("units_resumed"):
        table.add_row("tasks resumed from an earlier run", f"{counts['units_resumed']}")
    console.print(table)


def stats_table(stats: dict[str, Any]) -> None:
    console.print(
        f"[bold]{stats['dataset']}[/]: {stats['documents']:,} documents, {_size(stats['bytes'])}, "
        f"~{stats['tokens']:,} tokens" + (f", {stats['quarantined']:,} quarantined" if stats.get("quarantined") else "")
    )
    for key in ("kind", "lang", "source"):
        rows = stats[f"by_{key}"]
        table = Table(title=f"by {key}" + (f" (top 30 of {len(rows)})" if len(rows) > 30 else ""))
        for column in (key, "documents", "bytes", "~tokens"):
            table.add_column(column, justify="left" if column == key else "right")
        for row in rows[:30]:
            table.add_row(str(row[key]), f"{row['documents']:,}", _size(row["bytes"]), f"{row['tokens']:,}")
        console.print(table)


def document(row: dict[str, Any], full: bool) -> None:
    for key, value in row.items():
        if key in ("text", "raw_preview"):
            continue
        console.print(f"[bold]{key}[/]: {value}", highlight=False, markup=True)
    text = row.get("text") or row.get("raw_preview") or ""
    if text:
        shown = text if full or len(text) <= 2000 else text[:2000] + f"\n… ({len(text) - 2000:,} more characters; --full shows all)"
        console.rule("text" if "text" in row else "raw (preview)")
        console.print(shown, markup=False, highlight=False)


def story(doc_id: str, rows: list[dict[str, Any]]) -> None:
    if not rows:
        console.print(f"no decisions about {doc_id} in the given datasets")
        return
    table = Table(title=f"why {doc_id}")
    for column in ("dataset", "stage", "kept", "reason", "scores", "detail"):
        table.add_column(column)
    for row in rows:
        scores = ", ".join(f"{k}={v:.4g}" for k, v in row["scores"].items()) if row["scores"] else ""
        table.add_row(row["dataset"], row["stage"], "kept" if row["kept"] else "[red]dropped[/]",
                      row["reason"] or "", scores, row["detail"] or "")
    console.print(table)


def as_json(obj: Any) -> None:
    print(json.dumps(obj, indent=2, default=str, ensure_ascii=False))
