"""Human-readable tables for summaries, stats and lineage (rich), printed to stdout."""

from __future__ import annotations

import json
from typing import Any

from rich.console import Console
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from assay.history import version_grid
from assay.installation import describe
from assay.lineage import scores_behind

console = Console()
#: Wider than any table: the width a table is measured at for its natural width.
_UNBOUNDED = 1_000_000


def whole_column(table: Table, name: str, **options: Any) -> None:
    """A column whose values must reach the reader whole (document ids, commits, counts): on a
    terminal too narrow for the table they are folded inside their cells, as `assay diff` prints
    ids, never cut with "…" (rich's default); rich narrows the widest columns first."""
    table.add_column(name, overflow="fold", **options)


def print_table(table: Table) -> None:
    """Print `table`; when stdout is not a terminal (a pipe, a file, a script), at its natural width.

    Rich lays out for the terminal, or for 80 columns (or $COLUMNS) when there is none, and cut
    ids, commits and counts to fit ("corpus/deeply/nested/d…"). Off a terminal nobody reads the
    layout, and a folded id breaks grep and copy-paste into `assay why`: each id stays on one line.
    """
    if not console.is_terminal:
        natural = Measurement.get(console, console.options.update_width(_UNBOUNDED), table).maximum
        if natural > console.width:
            Console(file=console.file, width=natural).print(table)
            return
    console.print(table)


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
        table.add_row(Text(f"  kind={kind}"), f"{n:,}")
    table.add_row("quarantined", f"{counts['quarantined']:,}")
    for reason, n in counts.get("by_reason", {}).items():
        table.add_row(Text(f"  {reason}"), f"{n:,}")
    for what, n in counts.get("skipped", {}).items():
        table.add_row(Text(f"skipped: {what}"), f"{n:,}")
    table.add_row("bytes in / out", f"{_size(counts['bytes_in'])} / {_size(counts['bytes_out'])}")
    if timings.get("seconds"):
        table.add_row("time", f"{timings['seconds']:.1f} s ({timings.get('docs_per_second')} docs/s, {timings.get('mb_per_second')} MB/s)")
    if counts.get("units_resumed"):
        table.add_row("tasks resumed from an earlier run", f"{counts['units_resumed']}")
    console.print(table)


#: The packages whose versions move verdicts the most, named on `assay stats`'s made-by line.
MADE_BY_PACKAGES = ("torch", "transformers", "tokenizers", "pyarrow", "tree-sitter-language-pack")


def stats_table(stats: dict[str, Any]) -> None:
    _say(_line(
        (str(stats["dataset"]), "bold"), f": {stats['documents']:,} documents, {_size(stats['bytes'])}, "
        f"~{stats['tokens']:,} tokens" + (f", {stats['quarantined']:,} quarantined" if stats.get("quarantined") else "")
    ))
    made_by = stats.get("made_by")
    if isinstance(made_by, dict):  # a dataset written before installations were recorded has none
        _say(_line(f"made by {describe(made_by, MADE_BY_PACKAGES)} (--json lists every package)", highlight=False))
    for key in ("kind", "lang", "source"):
        rows = stats[f"by_{key}"]
        table = Table(title=f"by {key}" + (f" (top 30 of {len(rows)})" if len(rows) > 30 else ""))
        for column in (key, "documents", "bytes", "~tokens"):
            table.add_column(column, justify="left" if column == key else "right")
        for row in rows[:30]:
            table.add_row(Text(str(row[key])), f"{row['documents']:,}", _size(row["bytes"]), f"{row['tokens']:,}")
        console.print(table)


def _line(*parts: str | tuple[str, str], highlight: bool = True) -> Text:
    """One printed line of plain text and (text, style) parts, each taken literally: ids, paths,
    details and texts are the user's data, and as console markup a `[/]` in them was a MarkupError,
    a `[bold]` a style, a `:smile:` an emoji (and `rich.markup.escape` doubles a trailing backslash).
    `highlight` colours numbers and brackets as `console.print` does a str by default."""
    text = Text.assemble(*parts)
    return console.highlighter(text) if highlight else text


def _say(line: Text) -> None:
    """Print one line of `show`, `why` or `graph`. Off a terminal (a pipe, a file, a script) it is
    not wrapped: rich wrapped at 80 columns, and an id or path broken across two lines defeats
    grep and copying it into `assay why`. On a terminal rich wraps it to fit, as before."""
    console.print(line, soft_wrap=not console.is_terminal)


def document(row: dict[str, Any], full: bool) -> None:
    for key, value in row.items():
        if key in ("text", "raw_preview"):
            continue
        _say(_line((key, "bold"), f": {value}", highlight=False))
    text = row.get("text") or row.get("raw_preview") or ""
    if text:
        shown = text if full or len(text) <= 2000 else text[:2000] + f"\n… ({len(text) - 2000:,} more characters; --full shows all)"
        console.rule("text" if "text" in row else "raw (preview)")
        _say(Text(shown))


def story(doc_id: str, rows: list[dict[str, Any]]) -> None:
    if not rows:
        _say(_line(f"no decisions about {doc_id} in the given datasets"))
        return
    _say(_line((f"why {doc_id}", "bold"), f" ({len(rows)} decision(s), oldest first)"))
    for row in rows:
        verdict = [("kept", "green")] if row["kept"] else [("dropped", "red"), " ", (str(row["reason"]), "bold")]
        _say(_line(f"• {row['stage']} ({row['dataset']}): ", *verdict))
        if row.get("detail"):
            _say(Text(f"    detail: {row['detail']}"))
        scores = row.get("scores") or {}
        if scores:
            # What the reason rests on first (the value, then its threshold), then the rest by name.
            behind = scores_behind(row.get("reason"), scores)
            ordered = behind + sorted(kv for kv in scores.items() if kv not in behind)
            _say(Text("    scores: " + ", ".join(f"{k}={v:.4g}" for k, v in ordered)))


def as_json(obj: Any) -> None:
    print(json.dumps(obj, indent=2, default=str, ensure_ascii=False))


def stage_summary(manifest: dict[str, Any]) -> None:
    counts, timings = manifest["counts"], manifest.get("timings", {})
    table = Table(title=f"{manifest['stage']}: {len(manifest.get('shards', []))} shard(s) out")
    table.add_column("what")
    table.add_column("count", justify="right")
    table.add_row("documents in", f"{counts.get('input', 0):,}")
    table.add_row("kept", f"{counts.get('kept', 0):,}")
    table.add_row("dropped", f"{counts.get('dropped', 0):,}")
    by_filter: dict[str, int] = {}
    for reason, n in counts.get("by_reason", {}).items():
        by_filter[reason.split(":", 1)[0]] = by_filter.get(reason.split(":", 1)[0], 0) + n
    for name, n in sorted(by_filter.items(), key=lambda kv: -kv[1]):
        table.add_row(f"  {name}", f"{n:,}")
        for reason, m in sorted(counts["by_reason"].items(), key=lambda kv: -kv[1]):
            if reason.split(":", 1)[0] == name and reason != name:
                table.add_row(f"    {reason}", f"{m:,}")
    for key in ("embedded", "lang_corrected"):
        if key in counts:
            table.add_row(key, f"{counts[key]:,}")
    if counts.get("not_scored"):  # tier 2 kept these unjudged: it had no signal for them
        table.add_row("not scored (kept unjudged)", f"{counts['not_scored']:,}")
    # What the stage's own rules say of its input: a description, not a measurement
    # (the labelled effective-code ratio is bench/labelled_code.py's).
    ratio = manifest.get("rule_clean_share")
    if ratio and ratio.get("before") is not None:
        after = f"{ratio['after']:.1%}" if ratio.get("after") is not None else "-"
        table.add_row("rule-clean share", f"{ratio['before']:.1%} → {after}")
        if ratio.get("never_parsed") is not None:
            table.add_row("  never parsed", f"{ratio['never_parsed']:,}")
        for part, value in ratio["parts_before"].items():
            later = ratio["parts_after"].get(part)
            table.add_row(f"  {part}", f"{value:.1%} → {later:.1%}" if later is not None else f"{value:.1%}")
    if timings.get("seconds"):
        table.add_row("time", f"{timings['seconds']:.1f} s ({timings.get('docs_per_second')} docs/s)")
    if counts.get("units_resumed"):
        table.add_row("tasks resumed from an earlier run", f"{counts['units_resumed']}")
    console.print(table)


def quality_report(result: dict[str, Any]) -> None:
    training = result["training"]
    console.print(f"[bold]quality head[/] → {result['out']} ({result['recipe']}): {training['examples']} examples, "
                  f"{training['train']} train / {training['held_out']} held out, {training['seconds']} s")
    for name in ("head", "finetuned"):
        if name not in result:
            continue
        metrics = result[name]
        at = metrics["at_threshold"]
        console.print(f"{name}: held-out AUC {metrics['auc']:.4f}; at threshold {at['threshold']}: "
                      f"precision {at['precision']:.3f}, recall {at['recall']:.3f}, accuracy {at['accuracy']:.3f}; "
                      f"ECE {metrics['ece']:.3f}")
        table = Table(title=f"calibration ({name}, held out)")
        for column in ("score bin", "count", "mean predicted", "observed positive"):
            table.add_column(column, justify="right")
        for row in metrics["calibration"]:
            if row["count"]:
                table.add_row(f"{row['low']:.1f}-{row['high']:.1f}", str(row["count"]),
                              f"{row['mean_predicted']:.3f}", f"{row['observed_positive']:.3f}")
        console.print(table)


def hits(rows, json_output: bool, exact: bool) -> None:
    data = [{"doc_id": h.doc_id, "score": round(float(h.score), 6), "source": h.source, "status": h.status,
             **{k: v for k, v in (h.properties or {}).items() if k not in ("doc_id", "source", "status")}} for h in rows]
    if json_output:
        as_json({"exact": exact, "hits": data})
        return
    table = Table(title=f"{len(data)} nearest ({'exact' if exact else 'approximate: HNSW'} search)")
    table.add_column("score")
    whole_column(table, "doc_id")
    for column in ("source", "status", "path"):
        table.add_column(column)
    for h in data:  # Text: an id from the input ("[b]x") is text, not rich markup
        table.add_row(f"{h['score']:.4f}", Text(h["doc_id"]), Text(str(h["source"])), Text(str(h["status"])),
                      Text(str(h.get("path", ""))))
    print_table(table)


def clusters(doc_id: str, result: dict, json_output: bool) -> None:
    if json_output:
        as_json({"doc_id": doc_id, "clusters": result})
        return
    if not result:
        console.print(_line(f"{doc_id} is in no duplicate cluster"))
    for cluster_id, members in result.items():
        table = Table(title=Text(f"cluster {cluster_id} ({len(members)} members)"))
        whole_column(table, "doc_id")
        table.add_column("status")
        whole_column(table, "duplicate_of")
        for column in ("source", "path"):
            table.add_column(column)
        for m in members:
            table.add_row(Text(m.get("doc_id", "")), Text(str(m.get("status"))),
                          Text(str(m.get("duplicate_of") or "")), Text(str(m.get("source"))), Text(str(m.get("path"))))
        print_table(table)


def versions(found, repo) -> None:
    """`assay versions`' table: a row per version (`assay.history.Version`), a column per data output."""
    if not found:
        print("no dataset versions yet: no commit changed a data/ output in dvc.lock or a .dvc file")
        return
    paths, grid, errors = version_grid(found)
    table = Table(title=Text(f"dataset versions in {repo}"))
    whole_column(table, "commit")  # the short hash `assay diff` and git take
    table.add_column("date (UTC)")
    table.add_column("tags", overflow="fold")  # wrapped between tags, each whole
    table.add_column("message")
    for path in paths:
        whole_column(table, Text(path.removeprefix("data/")), justify="right")
    for version, outputs in zip(found, grid):
        cells = []
        for path, out in zip(paths, outputs):
            count = "" if out is None else "?" if out["documents"] is None else f"{out['documents']:,}"
            cells.append(f"[bold]{count}[/]" if out is not None and path in version.changed else count)
        table.add_row(version.commit[:8], version.date[:16].replace("T", " "), Text(", ".join(version.tags)),
                      Text(version.subject[:50]), *cells)
    print_table(table)
    console.print("bold: changed at that commit", style="dim")
    for error in errors:
        console.print(f"?: {error}", style="yellow", markup=False)


def overlap(rows, json_output: bool) -> None:
    data = [{"source_a": a, "source_b": b, "shared_clusters": n} for a, b, n in rows]
    if json_output:
        as_json(data)
        return
    table = Table(title="sources sharing duplicate clusters")
    for column in ("source", "source", "shared clusters"):
        table.add_column(column)
    for row in data:
        table.add_row(Text(str(row["source_a"])), Text(str(row["source_b"])), f"{row['shared_clusters']:,}")
    console.print(table if data else "no two sources share a duplicate cluster")


def source_counts(rows: list[tuple[str, int]], data: str, json_output: bool) -> None:
    data_rows = [{"source": name, "documents": n} for name, n in rows]
    if json_output:
        as_json(data_rows)
        return
    if not data_rows:
        print(f"no document in the graph of {data} has a source")
        return
    table = Table(title=Text(f"sources in the graph of {data}"))
    whole_column(table, "source")  # a name cut with "…" could not be grepped for
    whole_column(table, "documents", justify="right")
    for row in data_rows:  # Text: a source name from the input ("[b]x") is text, not rich markup
        table.add_row(Text(row["source"]), f"{row['documents']:,}")
    print_table(table)


def graph_node(node: dict, json_output: bool) -> None:
    if json_output:
        as_json(node)
        return
    _say(_line((str(node["doc_id"]), "bold"),
               f"  status: {node.get('status')}  source: {node.get('source')}  path: {node.get('path')}"))
    if node.get("duplicate_of"):
        _say(_line(f"  duplicate of: {node['duplicate_of']}"))
    for c in node.get("clusters", []):
        _say(_line(f"  in cluster: {c}"))
    for d in node.get("duplicated_by", []):
        _say(_line(f"  duplicated by: {d}"))
