"""The visual report: one static HTML page of what every tier kept and dropped, and why.

`assay report --out reports/` reads the pipeline's own outputs (the stage
datasets, the training runs, the domain model, and dvc.lock's git history) and
writes ``reports/index.html`` plus ``reports/why/<id>.txt``, the `assay why`
story of every example document the page links to.

The page works offline: plotly.js is inlined once (about 4.8 MB) and nothing
is fetched. Each section reads only its own inputs; a missing one makes that
section say what is missing and the command that produces it, never an
error, because a half-run pipeline (no round 1 before the loop has run) is
the normal case. Counts and histograms are computed here with Arrow and numpy
(binned before they reach the page), so the page's size does not grow with
the corpus.
"""

from __future__ import annotations

import hashlib
import html
import json
import math
import re
import subprocess
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from assay.errors import AssayError
from assay.installation import describe, installation
from assay.staging import overlaps, require_folder_or_absent, require_not_dangling
from assay.lineage import scores_behind
from assay.shards import (DECISIONS_DIR, MANIFEST, QUARANTINE_DIR, atomic_write_bytes, atomic_write_json, json_object,
                          list_shards, open_shard, read_shard, stream_shards)

__all__ = ["CHART_CLASS", "ReportInputs", "build_report", "duplicate_clusters", "dynamic_thresholds", "made_by",
           "measure_labelled_code", "require_stage_outputs", "why_stories"]

#: Every chart's container carries this class and `data-chart="<name>"`; the
#: browser test counts what Plotly drew inside each one.
CHART_CLASS = "assay-chart"
PAGE = "index.html"
WHY_DIR = "why"
#: Default place of the labelled effective-code measurement (`--measure-labelled`
#: writes it): beside the benchmark that measures the same thing, outside any
#: DVC output, so `dvc repro` does not delete it.
LABELLED_FILE = "bench/labelled_code.json"
HISTOGRAM_BINS = 40


@dataclass
class ReportInputs:
    """Where each input lives (each may be missing)."""

    raw: Path = Path("data/raw")
    static: Path = Path("data/static")
    domain: Path = Path("data/domain")
    dedup: Path = Path("data/dedup")
    curated: Path = Path("data/curated")
    round0: Path = Path("runs/round-0")
    round1: Path = Path("runs/round-1")
    models: Path = Path("models")
    labelled: Path = Path(LABELLED_FILE)
    #: The DVC project whose dvc.lock history is the version lineage.
    repo: Path = Path(".")

    @property
    def scores(self) -> Path:
        return self.round0 / "scores"

    def stage_dirs(self) -> list[tuple["StageInfo", Path]]:
        return [(stage, getattr(self, stage.attr)) for stage in STAGES]


@dataclass(frozen=True)
class StageInfo:
    name: str  # the decisions' `stage` value
    attr: str  # ReportInputs attribute
    label: str  # how the page names it
    produce: str  # the command that makes it


STAGES = (
    StageInfo("ingest", "raw", "ingest (bad input)", "assay ingest demo --out data/raw  (or `dvc repro ingest`)"),
    StageInfo("static", "static", "tier 1: static", "assay run static --in data/raw --out data/static  (or `dvc repro static`)"),
    StageInfo("domain", "domain", "tier 3: code", "assay run domain --in data/static --out data/domain  (or `dvc repro domain`)"),
    StageInfo("dedup", "dedup", "dedup", "assay run dedup --in data/domain --out data/dedup  (or `dvc repro dedup`)"),
    StageInfo("dynamic", "curated", "tier 2: dynamic",
              "assay score --run runs/round-0 --data data/dedup --out runs/round-0/scores, then "
              "assay run dynamic --in data/dedup --scores runs/round-0/scores --run runs/round-0 --out data/curated  "
              "(or `dvc repro dynamic`)"),
)
#: Each stage judges the documents of the one before it (ingest judges raw input).
STAGE_INPUT = {"static": "raw", "domain": "static", "dedup": "domain", "dynamic": "dedup"}
TRAIN_COMMAND = {"round0": "assay train --data data/dedup --out runs/round-0  (or `dvc repro train`)",
                 "round1": "assay train --data data/curated --out runs/round-1  (or `dvc repro train-1`)"}
SCORE_COMMAND = "assay score --run runs/round-0 --data data/dedup --out runs/round-0/scores  (or `dvc repro score`)"
#: What each input folder's option names, for the error when it is given something else.
FOLDER_OPTIONS = {**{stage.attr: f"the {stage.name} stage's output folder" for stage in STAGES},
                  "round0": "round 0's training run folder", "round1": "round 1's training run folder",
                  "models": "the folder of the trained models (holding domain/)"}


# --- reading ---------------------------------------------------------------------------------------------------


def _json(path: Path) -> dict[str, Any] | None:
    """A JSON file the pipeline wrote, or None when it is absent or half-written."""
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, NotADirectoryError, json.JSONDecodeError):
        return None
    except IsADirectoryError:
        raise AssayError(f"{path}: is a directory, not the JSON file expected there") from None


#: The report's own `summary.json` says so; reports written before it said so are known by their keys.
REPORT_FORMAT = "assay-report/1"
LABELLED_FORMAT = "assay-labelled-code/1"


def _earlier_report(out: Path) -> bool:
    found = json_object(out / "summary.json")
    return found is not None and (found.get("format") == REPORT_FORMAT or {"page", "sections", "charts"} <= found.keys())


def _input_folders(inputs: ReportInputs) -> list[tuple[str, Path]]:
    """Each folder the report reads, with its option: the datasets, the runs and the models."""
    return [*((stage.attr, folder) for stage, folder in inputs.stage_dirs()), ("round0", inputs.round0),
            ("round1", inputs.round1), ("models", inputs.models)]


def require_report_out(inputs: ReportInputs, out: Path) -> None:
    """Refuse an OUT whose report would land in a pipeline input (a dataset, a run, the models; its
    DVC hash would change) or replace files that are not an earlier report's: the report writes
    OUT/index.html, OUT/summary.json and OUT/why/, and keeps whatever else OUT holds."""
    require_not_dangling(out)
    require_folder_or_absent(out)
    for option, folder in _input_folders(inputs):
        overlap = overlaps(out, folder)
        if overlap:
            raise AssayError(f"{out}: {overlap} the report's input {folder} (--{option}); choose a folder of its own")
    ours = [name for name in (PAGE, "summary.json", WHY_DIR) if (out / name).exists()]
    if ours and not _earlier_report(out):
        raise AssayError(f"{out}: holds {', '.join(ours)}, not an earlier Assay report's, which the report would "
                         "replace; choose another --out")


def require_labelled_out(inputs: ReportInputs) -> None:
    """`--measure-labelled` writes its measurement over `--labelled`: only over an earlier one."""
    path = inputs.labelled
    require_not_dangling(path)
    if path.is_dir():
        raise AssayError(f"{path}: is a directory, not the labelled-code measurement (a JSON file)")
    for option, folder in _input_folders(inputs):
        if overlaps(path, folder):
            raise AssayError(f"{path}: lies inside the report's input {folder} (--{option}); choose another --labelled")
    if path.exists():
        found = json_object(path)
        if found is None or found.get("format") != LABELLED_FORMAT:
            raise AssayError(f"{path}: holds something other than a labelled-code measurement, which "
                             "--measure-labelled would replace; choose another --labelled")


def _manifest(directory: Path) -> dict[str, Any] | None:
    return _json(directory / MANIFEST)


def made_by(directory: Path) -> str | None:
    """The stage that made a dataset: its manifest's `stage`, else (no manifest) its decisions'; None
    when neither says (absent, unreadable: the sections say what is missing)."""
    manifest = _manifest(directory)
    if isinstance(manifest, dict) and isinstance(manifest.get("stage"), str):
        return manifest["stage"]
    shards = list_shards(directory / DECISIONS_DIR)
    if manifest is not None or not shards:
        return None
    try:
        parquet = pq.ParquetFile(shards[0])
        if not parquet.metadata.num_row_groups:
            return None
        stages = parquet.read_row_group(0, columns=["stage"]).column("stage")
    except (pa.ArrowException, OSError, KeyError):
        return None
    return stages[0].as_py() if len(stages) else None


def require_stage_outputs(inputs: ReportInputs) -> None:
    """Refuse an input folder's option given a file (`--raw FILE`: the Inputs table called it
    "present", the sections found nothing in it), and a stage option given another stage's output
    (`--static data/raw`: the page drew ingest's decisions as tier 1's, labelled tier 1). Checked
    before anything is read or written."""
    for option, folder in _input_folders(inputs):
        require_folder_or_absent(folder, f"--{option} takes {FOLDER_OPTIONS[option]}")
    if Path(inputs.labelled).is_dir():  # an option's mistake, not a damaged input: no page is drawn around it
        raise AssayError(f"{inputs.labelled}: is a directory, not the JSON file expected there (--labelled)")
    for stage, directory in inputs.stage_dirs():
        found = made_by(directory)
        if found is not None and found != stage.name:
            command = stage.produce.split("  (or")[0]
            raise AssayError(f"{directory}: a dataset made by stage '{found}', not '{stage.name}': --{stage.attr} "
                             f"takes the {stage.name} stage's output, made by `{command}`")


def _column_names(shard: Path) -> list[str]:
    return open_shard(shard, shard).schema_arrow.names


def _decisions(directory: Path, columns: list[str]) -> pa.Table | None:
    shards = stream_shards(directory, DECISIONS_DIR)  # a lost part is an error, not smaller counts
    if not shards:
        return None
    return pa.concat_tables(read_shard(s, columns=columns) for s in shards)


def _score(table: pa.Table, key: str) -> np.ndarray:
    """One key of the decisions' `scores` map, NaN where absent."""
    values = pc.map_lookup(table.column("scores"), key, "first")
    return np.asarray(pc.fill_null(values.cast(pa.float64()), math.nan).to_numpy(zero_copy_only=False), dtype=np.float64)


def _score_keys(table: pa.Table) -> set[str]:
    keys: set[str] = set()
    for chunk in table.column("scores").chunks:
        keys.update(pc.unique(chunk.keys).to_pylist())
    keys.discard(None)
    return keys


def _history(run: Path) -> list[dict[str, Any]] | None:
    try:
        lines = (run / "history.jsonl").read_text().splitlines()
    except (FileNotFoundError, NotADirectoryError):
        return None
    return [json.loads(line) for line in lines if line.strip()]


def _parquet_dir(directory: Path, columns: list[str] | None = None) -> pa.Table | None:
    shards = list_shards(directory)
    if not shards:
        return None
    tables = []
    for shard in shards:
        names = _column_names(shard)
        tables.append(read_shard(shard, columns=[c for c in columns if c in names] if columns else None))
    return pa.concat_tables(tables, promote_options="default")


# --- the page's pieces --------------------------------------------------------------------------------------------


#: Each section's key (its anchor) and title, in the page's order.
SECTION_TITLES = {
    "inputs": "Inputs",
    "flow": "Documents kept and dropped, per tier and reason",
    "scores": "Score histograms with their thresholds",
    "code-ratio": "Effective-code ratio before and after, on the labelled set",
    "clusters": "Duplicate clusters",
    "curves": "Loss curves of round 0 and round 1",
    "lineage": "Version lineage",
    "examples": "Example documents dropped, per reason",
}


@dataclass
class Section:
    key: str
    parts: list[str] = field(default_factory=list)  # HTML fragments, in order
    charts: list[str] = field(default_factory=list)

    @property
    def title(self) -> str:
        return SECTION_TITLES[self.key]

    def text(self, message: str) -> None:
        self.parts.append(f"<p>{message}</p>")

    def damaged(self, what: str, error: str) -> None:
        """An input that is there but cannot be read whole (a lost part, a corrupt file): named with its error,
        and drawn without, rather than drawn from what is left of it."""
        self.parts.append(f'<div class="damaged"><b>Damaged:</b> {html.escape(what)}: {html.escape(error)}</div>')

    @contextmanager
    def guard(self, what: str) -> Iterator[None]:
        """Draw the block inside, or, when an input of it is damaged, say so and go on with the next block:
        one damaged stage output costs its own charts, not the page."""
        try:
            yield
        except AssayError as exc:
            self.damaged(what, str(exc))

    def missing(self, what: str, how: str) -> None:
        self.parts.append(f'<div class="missing"><b>Missing:</b> {html.escape(what)}. '
                          f"Produce it with <code>{html.escape(how)}</code>.</div>")

    def chart(self, name: str, figure) -> None:
        div = figure.to_html(full_html=False, include_plotlyjs=False, div_id=f"chart-{name}",
                             config={"displaylogo": False, "responsive": True})
        self.parts.append(f'<div class="{CHART_CLASS}" data-chart="{name}">{div}</div>')
        self.charts.append(name)

    def table(self, header: list[str], rows: Iterable[list[str]], escape: bool = True, css: str = "") -> None:
        head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
        body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c)) if escape else c}</td>" for c in row) + "</tr>"
                       for row in rows)
        self.parts.append(f'<table class="{css}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>')


def _figure(**layout):
    import plotly.graph_objects as go

    figure = go.Figure()
    defaults = dict(template="plotly_white", margin=dict(l=60, r=20, t=50, b=50), height=380,
                    legend=dict(orientation="h", y=-0.2))
    figure.update_layout(**{**defaults, **layout})
    return figure


def _fmt(x: float | None, digits: int = 4) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    return f"{x:.{digits}g}"


def _pct(x: float | None) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{x:.1%}"


# --- 1. kept and dropped --------------------------------------------------------------------------------------------


def _group(reason: str) -> str:
    """A reason's filter: `gopher_quality:word_count` → `gopher_quality` (what the Sankey shows)."""
    return reason.split(":", 1)[0]


def stage_counts(directory: Path) -> dict[str, Any] | None:
    """{'input', 'kept', 'by_reason'} of a stage output, from its decisions (else its manifest)."""
    table = _decisions(directory, ["kept", "reason"])
    if table is not None:
        kept = int(pc.sum(table.column("kept")).as_py() or 0)
        dropped = table.filter(pc.invert(table.column("kept")))
        grouped = dropped.group_by("reason").aggregate([("kept", "count")])
        by_reason = {r: int(n) for r, n in zip(grouped.column("reason").to_pylist(), grouped.column("kept_count").to_pylist())}
        return {"input": table.num_rows, "kept": kept, "by_reason": dict(sorted(by_reason.items(), key=lambda kv: -kv[1]))}
    manifest = _manifest(directory)
    if manifest is None:
        return None
    counts = manifest.get("counts", {})
    if "input" in counts:
        return {"input": counts["input"], "kept": counts.get("kept", 0), "by_reason": counts.get("by_reason", {})}
    if "input_records" in counts:  # ingest's manifest
        return {"input": counts["input_records"], "kept": counts.get("documents", 0), "by_reason": counts.get("by_reason", {})}
    return None


def _flow_section(inputs: ReportInputs) -> Section:
    import plotly.graph_objects as go

    section = Section("flow")
    counts: dict[str, dict[str, Any]] = {}
    for stage, directory in inputs.stage_dirs():
        with section.guard(f"{stage.label}'s output {directory}"):
            found = stage_counts(directory)
            if found is None:
                section.missing(f"{stage.label}: no decisions or manifest in {directory}", stage.produce)
            else:
                counts[stage.name] = found
    if not counts:
        return section

    # Sankey: input → each stage's kept → …, with each stage's drops by filter.
    labels: list[str] = []
    node_colours: list[str] = []
    source, target, value, colours = [], [], [], []

    def node(label: str, colour: str) -> int:
        labels.append(label)
        node_colours.append(colour)
        return len(labels) - 1

    first = next(iter(counts.values()))
    previous = node(f"input ({first['input']:,})", "#4c78a8")
    for stage in STAGES:
        if stage.name not in counts:
            continue
        c = counts[stage.name]
        kept = node(f"{stage.label}: kept ({c['kept']:,})", "#54a24b")
        source.append(previous), target.append(kept), value.append(c["kept"]), colours.append("rgba(44,160,44,0.35)")
        by_group: Counter[str] = Counter()
        for reason, n in c["by_reason"].items():
            by_group[_group(reason)] += n
        for group, n in by_group.most_common():
            drop = node(f"{stage.label}: {group} ({n:,})", "#e45756")
            source.append(previous), target.append(drop), value.append(n), colours.append("rgba(214,39,40,0.35)")
        previous = kept
    sankey = _figure(title="Where the documents go (drops grouped by filter)", height=520)
    sankey.add_trace(go.Sankey(arrangement="snap", node=dict(label=labels, color=node_colours, pad=12, thickness=14),
                               link=dict(source=source, target=target, value=value, color=colours)))
    section.chart("flow-sankey", sankey)

    # Stacked bars: each stage's input split into kept and its reasons.
    bars = _figure(title="Each stage's input: kept and dropped by reason", barmode="stack", height=460,
                   yaxis_title="documents", showlegend=False)
    names = [s.label for s in STAGES if s.name in counts]
    bars.add_trace(go.Bar(name="kept", x=names, y=[counts[s.name]["kept"] for s in STAGES if s.name in counts],
                          marker_color="rgba(44,160,44,0.7)", hovertemplate="%{x}<br>kept: %{y:,}<extra></extra>"))
    reasons = sorted({r for c in counts.values() for r in c["by_reason"]})
    for reason in reasons:
        y = [counts[s.name]["by_reason"].get(reason, 0) for s in STAGES if s.name in counts]
        bars.add_trace(go.Bar(name=reason, x=names, y=y, hovertemplate=f"%{{x}}<br>{html.escape(reason)}: %{{y:,}}<extra></extra>"))
    section.chart("flow-bars", bars)

    rows = []
    for stage in STAGES:
        if stage.name not in counts:
            continue
        c = counts[stage.name]
        dropped = c["input"] - c["kept"]
        rows.append([stage.label, f"{c['input']:,}", f"{c['kept']:,}", f"{dropped:,}",
                     ", ".join(f"{r} {n:,}" for r, n in c["by_reason"].items()) or "-"])
    section.table(["stage", "in", "kept", "dropped", "dropped by reason"], rows)
    return section


# --- 2. score histograms ----------------------------------------------------------------------------------------------


def _histogram(title: str, series: dict[str, np.ndarray], thresholds: list[tuple[str, float]], log: bool = False,
               x_title: str = ""):
    """Binned in numpy (the page carries bins, not values), stacked, with a dashed line per threshold."""
    import plotly.graph_objects as go

    finite = {k: v[np.isfinite(v)] for k, v in series.items()}
    if log:
        finite = {k: v[v > 0] for k, v in finite.items()}
    values = np.concatenate([v for v in finite.values()]) if finite else np.zeros(0)
    figure = _figure(title=title, barmode="stack", xaxis_title=x_title, yaxis_title="documents", bargap=0.02)
    if values.size == 0:
        return None
    # A few extreme values (perplexity reaches 1e30 on some files) would squeeze every other bar into one:
    # far outliers are counted in the end bins, and the title says so.
    scale = np.log10 if log else (lambda a: a)
    scaled = scale(values)
    lo, hi = float(scaled.min()), float(scaled.max())
    p_lo, p_hi = (float(q) for q in np.percentile(scaled, [0.5, 99.5]))
    spread = max(p_hi - p_lo, 1e-12)
    clipped = lo < p_lo - 3 * spread or hi > p_hi + 3 * spread
    if clipped:
        lo, hi = max(lo, p_lo - spread), min(hi, p_hi + spread)
        for _, x in thresholds:  # a threshold stays on the axis
            if math.isfinite(x) and (not log or x > 0):
                lo, hi = min(lo, float(scale(x))), max(hi, float(scale(x)))
        shown = (10 ** lo, 10 ** hi) if log else (lo, hi)
        figure.update_layout(title=f"{title}<br><sup>values outside [{shown[0]:.4g}, {shown[1]:.4g}] are counted in the end bins</sup>")
        finite = {k: (10 ** np.clip(np.log10(v), lo, hi) if log else np.clip(v, lo, hi)) for k, v in finite.items()}
    if hi <= lo:
        hi = lo + 1
    edges = np.logspace(lo, hi, HISTOGRAM_BINS + 1) if log else np.linspace(lo, hi, HISTOGRAM_BINS + 1)
    centres = np.sqrt(edges[:-1] * edges[1:]) if log else (edges[:-1] + edges[1:]) / 2
    colours = {"kept": "#4c78a8", "dropped": "#e45756", "kept by tier 2": "#4c78a8", "dropped by tier 2": "#e45756",
               "clean reference set": "#54a24b"}
    for name, v in finite.items():
        counts, _ = np.histogram(v, edges)
        figure.add_trace(go.Bar(name=f"{name} ({v.size:,})", x=centres, y=counts, width=np.diff(edges),
                                marker_color=colours.get(name),
                                customdata=np.stack([edges[:-1], edges[1:]], axis=1),
                                hovertemplate="[%{customdata[0]:.4g}, %{customdata[1]:.4g}): %{y:,}<extra>" + name + "</extra>"))
    # A trace, not a shape: plotly reads a shape's x on a log axis as an exponent.
    stacked = sum(np.histogram(v, edges)[0] for v in finite.values())
    top = max(int(np.max(stacked)), 1)
    for label, x in thresholds:
        if math.isfinite(x) and (not log or x > 0):
            figure.add_trace(go.Scatter(x=[x, x], y=[0, top * 1.05], mode="lines", name=f"{label} {x:.4g}",
                                        line=dict(color="black", dash="dash", width=2),
                                        hovertemplate=f"{label} {x:.4g}<extra></extra>"))
    if log:
        figure.update_xaxes(type="log")
    return figure


def _kept_split(values: np.ndarray, kept: np.ndarray) -> dict[str, np.ndarray]:
    return {"kept": values[kept], "dropped": values[~kept]}


#: Per signal, its thresholds: {signal: {label: [distinct values]}}.
Thresholds = dict[str, dict[str, list[float]]]


def dynamic_thresholds(curated: Path) -> tuple[Thresholds, set[str]]:
    """The thresholds in tier 2's decisions, and the ids it dropped.

    The dynamic stage stores each value beside its threshold in the `scores`
    map: `alignment` with `alignment_threshold`, `loss_z` with
    `loss_z_high_threshold` and `loss_z_low_threshold`. A threshold key belongs
    to the longest value key it starts with; what is left (`high`, `low`)
    labels the line.
    """
    table = _decisions(curated, ["id", "kept", "scores"])
    if table is None:
        return {}, set()
    keys = _score_keys(table)
    values_keys = sorted((k for k in keys if not k.endswith("_threshold")), key=len, reverse=True)
    thresholds: Thresholds = {}
    for key in sorted(k for k in keys if k.endswith("_threshold")):
        base = key[: -len("_threshold")]
        signal = next((v for v in values_keys if base == v or base.startswith(v + "_")), base)
        label = (base[len(signal) + 1:].replace("_", " ") + " threshold").strip()
        values = _score(table, key)
        distinct = np.unique(values[np.isfinite(values)])
        if distinct.size:
            thresholds.setdefault(signal, {})[label] = distinct.tolist()
    dropped = set(table.filter(pc.invert(table.column("kept"))).column("id").to_pylist())
    return thresholds, dropped


def _threshold_lines(signal: str, thresholds: Thresholds) -> tuple[list[tuple[str, float]], str]:
    """The lines to draw for `signal`, and a sentence when thresholds differ by stratum (too many to draw)."""
    lines, note = [], ""
    for label, values in thresholds.get(signal, {}).items():
        if len(values) <= 4:
            lines += [(label, v) for v in values]
        else:
            lines += [(f"lowest {label}", values[0]), (f"highest {label}", values[-1])]
            note += (f" Tier 2's {label} on {signal} differs by stratum: {len(values)} values from {values[0]:.4g} "
                     f"to {values[-1]:.4g}.")
    return lines, note


def _scores_section(inputs: ReportInputs, thresholds: Thresholds, dropped: set[str], tier2_damage: str | None) -> Section:
    section = Section("scores")
    with section.guard(f"tier 1's decisions in {inputs.static}"):
        _quality_histogram(section, inputs)
    with section.guard(f"tier 3's decisions in {inputs.domain}"):
        _perplexity_histogram(section, inputs)
    if tier2_damage is not None:
        section.damaged(f"tier 2's decisions in {inputs.curated} (its thresholds and drops are not drawn)", tier2_damage)
    with section.guard(f"round 0's scores or telemetry ({inputs.scores}, {inputs.round0 / 'telemetry'})"):
        _tier2_histograms(section, inputs, thresholds, dropped, tier2_damage is not None)
    return section


def _quality_histogram(section: Section, inputs: ReportInputs) -> None:
    """Tier 1's quality score, with static.threshold as the stage recorded it."""
    table = _decisions(inputs.static, ["kept", "scores"])
    if table is None:
        section.missing(f"tier 1's decisions in {inputs.static}", STAGES[1].produce)
    else:
        quality = _score(table, "quality")
        kept = np.asarray(table.column("kept").to_numpy(zero_copy_only=False), dtype=bool)
        threshold = ((_manifest(inputs.static) or {}).get("params", {}).get("static", {}) or {}).get("threshold")
        has = np.isfinite(quality)
        figure = _histogram("Tier 1: quality score (text that passed the heuristics)", _kept_split(quality[has], kept[has]),
                            [("threshold", float(threshold))] if threshold is not None else [], x_title="P(high quality)")
        if figure is None:
            section.text(f"Tier 1 scored no document in {html.escape(str(inputs.static))} (no text passed the heuristics).")
        else:
            section.chart("score-quality", figure)


def _perplexity_histogram(section: Section, inputs: ReportInputs) -> None:
    """Tier 3's domain-model perplexity, with the screen and band the stage recorded."""
    table = _decisions(inputs.domain, ["kept", "scores"])
    if table is None:
        section.missing(f"tier 3's decisions in {inputs.domain}", STAGES[2].produce)
    else:
        perplexity = _score(table, "code_perplexity")
        kept = np.asarray(table.column("kept").to_numpy(zero_copy_only=False), dtype=bool)
        models = (_manifest(inputs.domain) or {}).get("models", {})
        lines = []
        screen = models.get("perplexity_screen") or []
        band = models.get("perplexity_band") or []
        has = np.isfinite(perplexity)
        top = float(perplexity[has].max()) if has.any() else 0.0
        for label, pair in (("screen", screen), ("band", band)):
            for side, x in zip(("floor", "ceiling"), pair or []):
                # An open ceiling (1e9) is no threshold to draw.
                if x is not None and (side == "floor" or x <= 10 * max(top, 1.0)):
                    lines.append((f"{label} {side}", float(x)))
        figure = _histogram("Tier 3: domain-model perplexity (code it screens)", _kept_split(perplexity[has], kept[has]),
                            lines, log=True, x_title="perplexity (log scale)")
        if figure is None:
            section.text("Tier 3 screened no code with its domain model (no file in the model's languages).")
        else:
            section.chart("score-perplexity", figure)


def _tier2_histograms(section: Section, inputs: ReportInputs, thresholds: Thresholds, dropped: set[str],
                      tier2_damaged: bool = False) -> None:
    """Tier 2's signals: the scoring pass when it ran, else round 0's telemetry; thresholds from its decisions."""
    scores = _parquet_dir(inputs.scores)
    drawn: set[str] = set()
    if scores is not None and scores.num_rows:
        last = pc.max(scores.column("step")).as_py() if "step" in scores.column_names else None
        if last is not None:
            scores = scores.filter(pc.equal(scores.column("step"), last))
        reference = (np.asarray(pc.fill_null(scores.column("reference"), False).to_numpy(zero_copy_only=False), dtype=bool)
                     if "reference" in scores.column_names else np.zeros(scores.num_rows, dtype=bool))
        was_dropped = np.asarray(pc.is_in(scores.column("sample_id"), value_set=pa.array(sorted(dropped), pa.string()))
                                 .to_numpy(zero_copy_only=False), dtype=bool)
        signals = [c for c in ("loss", "grad_norm", "alignment", "order_rise", "ref_loss") if c in scores.column_names]
        columns = {c: np.asarray(pc.fill_null(scores.column(c).cast(pa.float64()), math.nan).to_numpy(zero_copy_only=False))
                   for c in signals}
        if "ref_loss" in columns and np.isfinite(columns["ref_loss"]).any():
            columns["reducible_loss"] = columns["loss"] - columns["ref_loss"]
            signals.append("reducible_loss")
        note = ""
        for signal in signals:
            values = columns[signal]
            if not np.isfinite(values).any():
                continue
            lines, more = _threshold_lines(signal, thresholds)
            note += more
            series = {"kept by tier 2": values[~reference & ~was_dropped], "dropped by tier 2": values[~reference & was_dropped],
                      "clean reference set": values[reference]}
            figure = _histogram(f"Tier 2: {signal.replace('_', ' ')} (scoring pass at step {last})", series, lines,
                                x_title=signal)
            if figure is not None:
                section.chart(f"score-{signal}", figure)
                drawn.add(signal)
        if note:
            section.text(html.escape(note.strip()))
        if not thresholds and not tier2_damaged:
            section.missing(f"tier 2's decisions in {inputs.curated} (the thresholds drawn on these histograms)", STAGES[4].produce)
    else:
        section.missing(f"round 0's scoring pass in {inputs.scores} (loss, gradient norm and gradient alignment per document)",
                        SCORE_COMMAND)
        telemetry = _parquet_dir(inputs.round0 / "telemetry", ["sample_id", "loss", "grad_norm"])
        if telemetry is not None and telemetry.num_rows:
            per_doc = telemetry.group_by("sample_id").aggregate([("loss", "mean"), ("grad_norm", "max")])
            section.text("Until then, round 0's training telemetry: each document's mean loss over its draws and its "
                         "largest gradient norm (training sees only part of the corpus, often only some rows of a document).")
            for column, signal, label in (("loss_mean", "loss", "mean training loss"),
                                          ("grad_norm_max", "grad_norm", "largest gradient norm")):
                values = np.asarray(pc.fill_null(per_doc.column(column).cast(pa.float64()), math.nan).to_numpy(zero_copy_only=False))
                lines, _ = _threshold_lines(signal, thresholds)
                figure = _histogram(f"Round 0 telemetry: {label} per document", {"documents": values}, lines, x_title=label)
                if figure is not None:
                    section.chart(f"telemetry-{signal}", figure)
                    drawn.add(signal)
        elif _history(inputs.round0) is None:
            section.missing(f"round 0 in {inputs.round0}", TRAIN_COMMAND["round0"])
    # Signals tier 2 judged that neither the scores nor the telemetry carry (e.g. a z-score).
    if thresholds:
        table = _decisions(inputs.curated, ["kept", "scores"])
        kept = np.asarray(table.column("kept").to_numpy(zero_copy_only=False), dtype=bool)
        for signal in sorted(set(thresholds) - drawn):
            values = _score(table, signal)
            if not np.isfinite(values).any():
                continue
            lines, more = _threshold_lines(signal, thresholds)
            figure = _histogram(f"Tier 2: {signal.replace('_', ' ')} (from its decisions)", _kept_split(values, kept),
                                lines, x_title=signal)
            if figure is not None:
                section.chart(f"dynamic-{signal.replace(':', '-')}", figure)
                if more:
                    section.text(html.escape(more.strip()))


# --- 3. effective-code ratio on the labelled set ---------------------------------------------------------------------


def measure_labelled_code(model: Path, params_file: str | None = None, seed: int = 0) -> dict[str, Any]:
    """Tier 3 on the labelled set (assay.domain.labelled), as bench/labelled_code.py measures it.

    Returns, per split (evaluation; fresh: packages no calibration ever saw)
    and share of generated files (5%, 30%, 60%), the effective-code ratio
    (hand-written share) before and after each rule, each part and the whole
    stage. Costs a build of the set and one
    pass of the domain model over it (1-2 minutes of CPU on 2 cores).
    """
    import dataclasses

    from assay.config import load_params
    from assay.domain.evaluate import SHARES, judge_labelled, mix, score_mix
    from assay.domain.labelled import EVALUATION, FRESH, build_labelled_set
    from assay.domain.perplexity import PerplexityScorer
    from assay.stages.shard_stage import file_fingerprint

    if not Path(model).exists():
        raise AssayError(f"{model}: no domain model; train it with `assay domain train --data data/static --out {model}`")
    params = load_params(params_file).domain
    params = dataclasses.replace(params, model=dataclasses.replace(params.model, model=str(model)))
    scorer = PerplexityScorer(params.model)
    verdicts = judge_labelled(build_labelled_set(), params, scorer)
    mixes = []
    for split in (EVALUATION, FRESH):
        for share in SHARES:
            idx = mix(verdicts, share, split, seed)
            if not len(idx):  # a split without generated (or hand-written) files has no such mix
                continue
            before, rows = score_mix(verdicts, idx, params)
            generated = int(verdicts.generated[idx].sum())
            mixes.append({"split": split, "share": share, "files": int(len(idx)), "generated": generated,
                          "before": before, "rows": [dataclasses.asdict(r) for r in rows]})
    return {"format": LABELLED_FORMAT, "seed": seed, "model": str(model),
            "model_fingerprint": file_fingerprint(model), "languages": scorer.languages,
            "min_perplexity": params.model.min_perplexity,
            "max_literal_line_fraction": params.rules.max_literal_line_fraction,
            "created_at": datetime.now(timezone.utc).isoformat(), "mixes": mixes}


def _labelled_section(inputs: ReportInputs) -> Section:
    import plotly.graph_objects as go

    section = Section("code-ratio")
    section.text("The share of hand-written files among the code kept (the effective-code ratio), on mixes with 5%, "
                 "30% and 60% generated files of the labelled set's evaluation split and of its fresh split (packages "
                 "no calibration saw); labelled by provenance, not by the stage's own rules.")
    how = f"assay report --out reports/ --measure-labelled   (writes {inputs.labelled}; needs models/domain)"
    try:
        measured = json.loads(Path(inputs.labelled).read_text())
        mixes = measured["mixes"]
    except FileNotFoundError:
        measured, mixes = None, None
        section.missing(f"the labelled measurement {inputs.labelled}", how)
    except IsADirectoryError:
        raise AssayError(f"{inputs.labelled}: is a directory, not the JSON file expected there (--labelled)") from None
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as exc:
        measured, mixes = None, None
        section.missing(f"a readable labelled measurement ({inputs.labelled}: {exc})", how)
    if mixes:
        from assay.stages.shard_stage import file_fingerprint

        model = inputs.models / "domain"
        if model.exists() and measured.get("model_fingerprint") not in (None, file_fingerprint(model)):
            section.parts.append(f'<div class="missing">Measured with another domain model than {html.escape(str(model))} '
                                 f"holds now; rerun <code>{html.escape(how)}</code>.</div>")
        figure = _figure(title="Effective-code ratio before and after tier 3", barmode="group", height=460,
                         xaxis=dict(tickangle=0), legend=dict(orientation="h", y=-0.3),
                         yaxis=dict(title="hand-written share of the code kept", tickformat=".0%", range=[0, 1.05]))
        x = [f"{m.get('split', 'evaluation')}<br>{m['share']:.0%} generated<br>({m['files']} files)" for m in mixes]
        parts = ["part:rules", "part:syntax", "part:screen", "stage"]
        figure.add_trace(go.Bar(name="before", x=x, y=[m["before"] for m in mixes], marker_color="#999"))
        for part in parts:
            y = [next((r["kept_hand_share"] for r in m["rows"] if r["name"] == part), None) for m in mixes]
            figure.add_trace(go.Bar(name=f"after {part}" if part != "stage" else "after the stage", x=x, y=y))
        section.chart("code-ratio", figure)
        rows = []
        for m in mixes:
            stage = next((r for r in m["rows"] if r["name"] == "stage"), {})
            rows.append([m.get("split", "evaluation"), f"{m['share']:.0%}", m["files"], m["generated"], _pct(m["before"]),
                         _pct(stage.get("kept_hand_share")),
                         _pct(stage.get("generated_recall")), _pct(stage.get("hand_keep_rate"))])
        section.table(["split", "generated share", "files", "generated", "ratio before", "ratio after",
                       "generated dropped", "hand-written kept"], rows)
        languages = ", ".join(measured.get("languages") or []) or "every language"
        section.text(f"Model {html.escape(str(measured.get('model')))} (screens {html.escape(languages)}), "
                     f"min_perplexity {measured.get('min_perplexity')}, measured {html.escape(str(measured.get('created_at', '')))}.")
    share = (_manifest(inputs.domain) or {}).get("rule_clean_share")
    if share and share.get("before") is not None:
        section.text(f"On this corpus ({html.escape(str(inputs.domain))}), the stage's own rules describe "
                     f"{_pct(share['before'])} of the code as clean before and {_pct(share.get('after'))} after "
                     f"({share.get('code_in', '-')} code files in, {share.get('code_kept', '-')} kept): a description by "
                     "the rules themselves, not a measurement.")
    return section


# --- 4. duplicate clusters ----------------------------------------------------------------------------------------------


def duplicate_clusters(dedup: Path) -> list[tuple[int, str]] | None:
    """(size, kind) of every duplicate cluster: the kept document and all that were dropped as its duplicates.

    Edges come from the decisions' `duplicate of <id>` details; chains (an exact
    duplicate of a near duplicate) join one cluster. Kind is the dedup step
    that dropped its members, or `mixed`.
    """
    table = _decisions(dedup, ["id", "kept", "reason", "detail"])
    if table is None:
        return None
    dropped = table.filter(pc.and_(pc.invert(table.column("kept")), pc.starts_with(pc.fill_null(table.column("detail"), ""), "duplicate of ")))
    parent: dict[str, str] = {}

    def find(x: str) -> str:
        root = x
        while parent.get(root, root) != root:
            root = parent[root]
        while parent.get(x, x) != root:
            parent[x], x = root, parent[x]
        return root

    kinds: dict[str, str] = {}
    for doc, reason, detail in zip(dropped.column("id").to_pylist(), dropped.column("reason").to_pylist(),
                                   dropped.column("detail").to_pylist()):
        other = detail[len("duplicate of "):].strip()
        a, b = find(doc), find(other)
        if a != b:
            parent[a] = b
        kinds[doc] = reason
    members: dict[str, list[str]] = defaultdict(list)
    for doc in {*parent, *parent.values()}:
        members[find(doc)].append(doc)
    out = []
    for root, docs in members.items():
        reasons = {kinds[d] for d in docs if d in kinds}
        out.append((len(docs), reasons.pop() if len(reasons) == 1 else "mixed"))
    return out


def _dedup_section(inputs: ReportInputs) -> Section:
    import plotly.graph_objects as go

    section = Section("clusters")
    clusters = duplicate_clusters(inputs.dedup)
    if clusters is None:
        section.missing(f"dedup's decisions in {inputs.dedup}", STAGES[3].produce)
        return section
    if not clusters:
        section.text("Dedup found no duplicates: every cluster has one member.")
        return section
    sizes = Counter(clusters)
    # A log axis only when pairs outnumber the big clusters by far (they usually do at scale).
    spread = max(sizes.values()) / min(sizes.values())
    figure = _figure(title="Duplicate cluster sizes (the kept document and its dropped duplicates)", barmode="stack",
                     xaxis=dict(title="cluster size (documents)", dtick=1),
                     yaxis=dict(title="clusters", type="log" if spread > 20 else "linear"))
    for kind in sorted({k for _, k in clusters}):
        xs = sorted(s for s, k in sizes if k == kind)
        figure.add_trace(go.Bar(name=kind, x=xs, y=[sizes[(s, kind)] for s in xs],
                                hovertemplate="size %{x}: %{y} clusters<extra>" + kind + "</extra>"))
    section.chart("cluster-sizes", figure)
    total = sum(s for s, _ in clusters)
    largest = max(s for s, _ in clusters)
    manifest = _manifest(inputs.dedup) or {}
    graph = manifest.get("graph", {})
    section.text(f"{len(clusters):,} clusters hold {total:,} documents; the largest has {largest:,}. "
                 f"{total - len(clusters):,} duplicates were dropped, one document kept per cluster."
                 + (f" The knowledge graph ({html.escape(str(graph.get('backend')))}) holds {graph.get('clusters'):,} "
                    f"cluster nodes{_cluster_kinds(graph.get('clusters_by_kind'))}, one per group of each kind, so "
                    "a document in an exact and a near-duplicate group is in two; <code>assay cluster ID</code> "
                    "lists one's members." if isinstance(graph.get("clusters"), int) else ""))
    return section


def _cluster_kinds(by_kind: Any) -> str:
    """The kinds of the graph's cluster nodes from the manifest's counts, as ' (12 exact, 30 near-duplicate,
    8 semantic)'; '' where it has none (a dedup output from before 2026-12-07)."""
    names = {"exact": "exact", "near": "near-duplicate", "semantic": "semantic"}
    if not isinstance(by_kind, dict) or not by_kind:
        return ""
    return " (" + ", ".join(f"{n:,} {names.get(k, html.escape(str(k)))}" for k, n in by_kind.items()
                            if isinstance(n, int)) + ")"


# --- 5. loss curves -------------------------------------------------------------------------------------------------------


def _flagged_steps(run: Path, ids: set[str]) -> dict[int, int]:
    """Per step of `run`, how many of the documents in `ids` it trained on."""
    if not ids:
        return {}
    telemetry = _parquet_dir(run / "telemetry", ["step", "sample_id"])
    if telemetry is None:
        return {}
    hit = telemetry.filter(pc.is_in(telemetry.column("sample_id"), value_set=pa.array(sorted(ids), pa.string())))
    grouped = hit.group_by("step").aggregate([("sample_id", "count_distinct")])
    return dict(zip(grouped.column("step").to_pylist(), grouped.column("sample_id_count_distinct").to_pylist()))


def _curves_section(inputs: ReportInputs, dropped: set[str], tier2_damage: str | None) -> Section:
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    section = Section("curves")
    if tier2_damage is not None:
        section.damaged(f"tier 2's decisions in {inputs.curated} (the steps of the documents it dropped are not "
                        "marked)", tier2_damage)
    runs = {"round 0": inputs.round0, "round 1": inputs.round1}
    histories = {name: _history(path) for name, path in runs.items()}
    for (name, path), key in zip(runs.items(), ("round0", "round1")):
        if histories[name] is None:
            section.missing(f"{name}'s history in {path}", TRAIN_COMMAND[key])
    if not any(histories.values()):
        return section
    figure = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.08,
                           subplot_titles=("training loss", "gradient norm"))
    figure.update_layout(template="plotly_white", height=620, margin=dict(l=60, r=20, t=60, b=50),
                         legend=dict(orientation="h", y=-0.12), title="Training curves, skipped steps and flagged documents")
    colours = {"round 0": "#1f77b4", "round 1": "#ff7f0e"}
    rows = []
    for name, history in histories.items():
        if not history:
            continue
        steps = [h["step"] for h in history]
        figure.add_trace(go.Scatter(x=steps, y=[h["loss"] for h in history], mode="lines", name=f"{name} loss",
                                    line=dict(color=colours[name])), row=1, col=1)
        figure.add_trace(go.Scatter(x=steps, y=[h.get("grad_norm") for h in history], mode="lines", name=f"{name} gradient norm",
                                    line=dict(color=colours[name], dash="dot")), row=2, col=1)
        skipped = [h for h in history if h.get("skipped")]
        if skipped:
            figure.add_trace(go.Scatter(x=[h["step"] for h in skipped], y=[h["loss"] for h in skipped], mode="markers",
                                        name=f"{name} skipped steps ({len(skipped)})", text=[h["skipped"] for h in skipped],
                                        marker=dict(symbol="x", size=11, color="#d62728"),
                                        hovertemplate="step %{x}: %{text}<extra></extra>"), row=1, col=1)
        flagged = _flagged_steps(runs[name], dropped) if name == "round 0" else {}
        if flagged:
            by_step = {h["step"]: h["loss"] for h in history}
            xs = [s for s in sorted(flagged) if s in by_step]
            figure.add_trace(go.Scatter(
                x=xs, y=[by_step[s] for s in xs], mode="markers", name="steps with documents tier 2 dropped",
                customdata=[flagged[s] for s in xs],
                marker=dict(symbol="circle-open", color="#9467bd", line=dict(width=2),
                            size=[9 + 3 * min(flagged[s], 6) for s in xs]),
                hovertemplate="step %{x}: %{customdata} document(s) tier 2 dropped<extra></extra>"), row=1, col=1)
        metrics = _json(runs[name] / "metrics.json") or {}
        if metrics.get("val_loss") is not None:
            figure.add_hline(y=metrics["val_loss"], line_dash="dash", line_color=colours[name], row=1, col=1,
                             annotation_text=f"{name} held-out loss {metrics['val_loss']:.3f}")
        data = metrics.get("data") or {}
        rows.append([name, len(history), _fmt(history[-1]["loss"]), _fmt(metrics.get("val_loss")),
                     len(skipped), sum(flagged.values()), str(data.get("path", "-")), str(data.get("data_hash", "-"))])
    section.chart("loss-curves", figure)
    section.table(["run", "steps", "final loss", "held-out loss", "skipped steps", "draws of documents tier 2 dropped",
                   "trained on", "data hash"], rows)
    if not dropped and inputs.curated.exists() is False:
        section.text("Flagged documents appear once tier 2 has run (data/curated).")
    return section


# --- 6. version lineage ------------------------------------------------------------------------------------------------


def _lineage_section(inputs: ReportInputs) -> Section:
    """`assay versions` as a table and a chart: each commit that changed a data/ output, read without a checkout."""
    import plotly.graph_objects as go

    from assay.history import list_versions, version_grid

    section = Section("lineage")
    how = "dvc repro, then git add dvc.lock && git commit  (each commit that changes a data/ output is a version)"
    try:
        versions = list_versions(inputs.repo)
    except AssayError as exc:
        section.missing(f"dataset versions ({exc})", how)
        return section
    if not versions:
        section.missing(f"a commit of dvc.lock with data outputs in {inputs.repo}", how)
        return section
    try:
        status = subprocess.run(["git", "status", "--porcelain", "--", "dvc.lock"], cwd=inputs.repo,
                                capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        status = ""
    if status.strip():
        section.parts.append('<div class="missing">The workspace\'s dvc.lock is not committed: the newest outputs are '
                             "not a version yet (<code>git add dvc.lock && git commit</code>).</div>")
    paths, grid, errors = version_grid(versions)
    rows = []
    for version, outputs in zip(versions, grid):
        cells = []
        for path, out in zip(paths, outputs):
            if out is None:
                cells.append('<span class="dim">-</span>')
                continue
            n = out.get("documents")
            count = f"{n:,} docs" if isinstance(n, int) else "? docs"
            css = "changed" if path in version.changed else "dim"
            cells.append(f'<span class="{css}" title="{html.escape(out["md5"])}">{count}<br>'
                         f"<small>{html.escape(out['md5'][:8])}</small></span>")
        name = html.escape(version.commit[:8]) + "".join(f' <span class="tag">{html.escape(t)}</span>' for t in version.tags)
        rows.append([f"<code>{name}</code>", html.escape(version.date[:16].replace("T", " ")),
                     html.escape(version.subject[:80]), *cells])
    section.text("Each git commit that changed a data/ output (dvc.lock or a .dvc file), newest first: documents "
                 "per dataset and the first digits of DVC's hash, highlighted where it changed. Read at each commit "
                 "through DVC; nothing is checked out. <code>assay versions</code> prints the same, "
                 "<code>assay diff REV_A REV_B</code> lists the documents that changed and why, and "
                 "<code>assay train --rev REV</code> trains on any of them.")
    section.table(["commit", "date (UTC)", "message", *[p.removeprefix("data/") for p in paths]], rows, escape=False,
                  css="lineage")
    figure = _figure(title="Documents per dataset, by version (oldest left)", yaxis_title="documents")
    for column, path in enumerate(paths):
        points = [(v.commit[:8], row[column]["documents"]) for v, row in zip(reversed(versions), reversed(grid))
                  if row[column] is not None and isinstance(row[column].get("documents"), int)]
        if points:
            figure.add_trace(go.Scatter(x=[p[0] for p in points], y=[p[1] for p in points], mode="lines+markers",
                                        name=path))
    if figure.data:
        figure.update_xaxes(type="category", title="commit")
        section.chart("lineage-counts", figure)
    for error in errors[:3]:
        section.text(f"? docs: {html.escape(error)}")
    return section


# --- 7. examples, with `assay why` ------------------------------------------------------------------------------------


def why_stories(ids: list[str], datasets: list[Path]) -> dict[str, list[dict[str, Any]]]:
    """`assay.lineage.why` for many ids at once: each decisions shard is read once, not once per id."""
    wanted = pa.array(sorted(set(ids)), pa.string())
    stories: dict[str, list[dict[str, Any]]] = {i: [] for i in ids}
    for directory in datasets:
        created = (_manifest(directory) or {}).get("created_at", "")
        for shard in stream_shards(directory, DECISIONS_DIR):
            table = read_shard(shard, filters=pc.field("id").isin(wanted))
            for row in table.to_pylist():
                row["scores"] = dict(row["scores"]) if row["scores"] else {}
                stories[row["id"]].append({"dataset": str(directory), "created_at": created, **row})
    for rows in stories.values():
        rows.sort(key=lambda r: (r["created_at"], r["dataset"]))
    return stories


#: An id that can name a file as it is: Assay's own ids (hex digests) and other plain names.
_PLAIN_ID = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,127}")


def why_file_name(doc_id: str) -> str:
    """The file under why/ for a document's story. Ids come from the input (``--id-field``), so one
    such as ``../../x`` must not name a path outside the report: any id that is not a plain name is
    written under a digest of it."""
    if _PLAIN_ID.fullmatch(doc_id):
        return f"{doc_id}.txt"
    return f"id-{hashlib.blake2b(doc_id.encode('utf-8', 'surrogatepass'), digest_size=16).hexdigest()}.txt"


def _story_text(doc_id: str, rows: list[dict[str, Any]]) -> str:
    """Exactly what `assay why` prints (the same renderer), without terminal colours."""
    from rich.text import Text

    from assay import report

    with report.console.capture() as captured:
        report.story(doc_id, rows)
    return Text.from_ansi(captured.get()).plain


def _documents(directory: Path, ids: set[str], columns: list[str]) -> dict[str, dict[str, Any]]:
    found: dict[str, dict[str, Any]] = {}
    if not ids:
        return found
    wanted = pa.array(sorted(ids), pa.string())
    for shard in list_shards(directory):
        names = _column_names(shard)
        table = read_shard(shard, columns=[c for c in columns if c in names], filters=pc.field("id").isin(wanted))
        for row in table.to_pylist():
            found[row["id"]] = row
    return found


def _examples_section(inputs: ReportInputs, out: Path, per_reason: int) -> Section:
    section = Section("examples")
    if not any(list_shards(d / DECISIONS_DIR) for _, d in inputs.stage_dirs()):
        section.missing("any stage's decisions", STAGES[0].produce)
        return section
    datasets: list[Path] = []  # those whose decisions read whole: the `why` stories are told from these
    chosen: list[tuple[StageInfo, str, str, dict[str, float], str | None]] = []
    for stage, directory in inputs.stage_dirs():
        table = None
        with section.guard(f"{stage.label}'s decisions in {directory} (no examples of its drops)"):
            table = _decisions(directory, ["id", "kept", "reason", "scores", "detail"])
        if table is None:
            continue
        datasets.append(directory)
        dropped = table.filter(pc.invert(table.column("kept")))
        if dropped.num_rows == 0:
            continue
        # The smallest ids of each reason: a stable choice that does not depend on shard order.
        dropped = dropped.sort_by([("reason", "ascending"), ("id", "ascending")])
        reasons = np.asarray(pc.fill_null(dropped.column("reason"), "").to_pylist(), dtype=object)
        _, starts, sizes = np.unique(reasons, return_index=True, return_counts=True)
        rows = np.concatenate([np.arange(a, a + min(n, per_reason)) for a, n in zip(starts, sizes)])
        for row in dropped.take(pa.array(np.sort(rows))).to_pylist():
            chosen.append((stage, row["reason"], row["id"], dict(row["scores"] or {}), row["detail"]))
    if not chosen:
        section.text("No stage dropped any document.")
        return section

    # Where each example came from: the dropping stage's input (ingest: its quarantine).
    columns = ["id", "source", "path", "kind", "lang", "text"]
    lookups: dict[str, set[str]] = defaultdict(set)
    for stage, _, doc_id, _, _ in chosen:
        lookups["quarantine" if stage.name == "ingest" else STAGE_INPUT[stage.name]].add(doc_id)
    rows_by_id: dict[str, dict[str, Any]] = {}
    for where, ids in lookups.items():
        directory = inputs.raw / QUARANTINE_DIR if where == "quarantine" else getattr(inputs, where)
        rows_by_id.update(_documents(directory, ids, columns if where != "quarantine" else ["id", "source", "path", "raw"]))

    stories = why_stories([c[2] for c in chosen], datasets)
    why_dir = out / WHY_DIR
    why_dir.mkdir(parents=True, exist_ok=True)
    command = "assay why {id} " + " ".join(f"--data {d}" for d in datasets)
    table_rows = []
    for stage, reason, doc_id, scores, detail in chosen:
        text = _story_text(doc_id, stories[doc_id])
        story_file = why_file_name(doc_id)
        atomic_write_bytes(why_dir / story_file, (f"$ {command.format(id=doc_id)}\n{text}").encode())
        document = rows_by_id.get(doc_id, {})
        raw = document.get("raw")  # quarantined input keeps its bytes, not a text
        preview = (document.get("text") or (raw[:160].decode("utf-8", errors="replace") if raw else ""))[:160]
        # The scores behind the reason, value and threshold first; never an unrelated filter's.
        evidence = ", ".join(f"{k}={v:.4g}" for k, v in scores_behind(reason, scores)[:3])
        if detail:
            evidence = f"{evidence}; {detail}" if evidence else detail
        where = f"{document.get('source', '?')}:{document.get('path', '?')}" if document else "-"
        table_rows.append([
            html.escape(stage.label), f"<code>{html.escape(reason)}</code>",
            f'<a href="{WHY_DIR}/{html.escape(story_file)}"><code>{html.escape(doc_id[:12])}</code></a>'
            f"<details><summary>why</summary><pre>{html.escape(text)}</pre></details>",
            html.escape(where), html.escape(evidence),
            f'<span class="preview">{html.escape(preview)}</span>'])
    section.text(f"Up to {per_reason} per reason (the smallest ids). Each id links to its "
                 f"<code>assay why</code> story, saved beside this page in <code>{WHY_DIR}/</code>.")
    section.table(["stage", "reason", "document", "source:path", "scores / detail", "text"], table_rows, escape=False,
                  css="examples")
    return section


# --- the page ----------------------------------------------------------------------------------------------------------------

CSS = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 0 auto; max-width: 1280px; padding: 0 24px 60px; color: #222; }
h1 { margin-top: 24px; } h2 { border-bottom: 1px solid #ddd; padding-bottom: 4px; margin-top: 40px; }
nav a { margin-right: 14px; } table { border-collapse: collapse; margin: 12px 0; font-size: 13px; }
th, td { border: 1px solid #ddd; padding: 4px 8px; text-align: left; vertical-align: top; }
th { background: #f5f5f5; } .missing { background: #fff4e5; border-left: 4px solid #f0a030; padding: 8px 12px; margin: 8px 0; }
.damaged { background: #fdecea; border-left: 4px solid #d62728; padding: 8px 12px; margin: 8px 0; }
.changed { background: #e6f4ea; font-weight: 600; } .dim { color: #888; } .tag { background: #eef; padding: 0 4px; }
.preview { font-family: ui-monospace, monospace; font-size: 12px; white-space: pre-wrap; color: #555; }
pre { white-space: pre-wrap; font-size: 12px; background: #fafafa; padding: 8px; }
.examples td { max-width: 260px; overflow-wrap: anywhere; } .examples td:nth-child(6) { max-width: 360px; }
.assay-chart { margin: 12px 0; }
"""


def _head_section(inputs: ReportInputs) -> Section:
    section = Section("inputs")
    rows, installations = [], {}
    for label, path in [("raw", inputs.raw), ("static", inputs.static), ("domain", inputs.domain), ("dedup", inputs.dedup),
                        ("curated", inputs.curated), ("round 0", inputs.round0), ("round 0 scores", inputs.scores),
                        ("round 1", inputs.round1), ("quality head", inputs.models / "quality"),
                        ("domain model", inputs.models / "domain"), ("labelled measurement", inputs.labelled)]:
        manifest = _manifest(path) if path.is_dir() else None
        state = "present" if path.exists() else "missing"
        if isinstance(manifest, dict) and manifest.get("created_at"):
            state += f" (written {manifest['created_at'][:19].replace('T', ' ')})"
        record = _installation_of(path, manifest)
        made = _installation_text(record) if record else "-"
        if made != "-":
            installations.setdefault(made, []).append(label)
        rows.append([label, str(path), state, made])
    section.table(["input", "path", "state", "made by"], rows)
    if len(installations) > 1:  # a pipeline rerun in part after an upgrade or a code change
        section.parts.append('<div class="missing"><b>Made by ' + str(len(installations)) + " installations:</b> "
                             + "; ".join(f"{html.escape(', '.join(labels))}: {html.escape(made)}"
                                         for made, labels in installations.items())
                             + ". To judge every stage with one, rerun those this installation ("
                             + html.escape(_installation_text(installation())) + ") did not make with "
                               "<code>--overwrite</code> (<code>dvc repro -f STAGE</code>).</div>")
    return section


#: Where an input that is not a dataset records what made it: a run's metrics.json, the quality head's
#: config.json (assay.quality.head.CONFIG), the domain model's report (assay.domain.perplexity.REPORT).
_RECORDS = ("metrics.json", "config.json", "assay_domain_model.json")


def _installation_of(path: Path, manifest: Any) -> dict[str, Any] | None:
    """What made `path` (assay.installation), as its manifest (a dataset's, scores') or a record beside it
    (_RECORDS) says; None for inputs that record none (a measurement, outputs of an earlier Assay)."""
    records = [_json(path / name) for name in _RECORDS] if path.is_dir() and manifest is None else []
    for found in (manifest, *records):
        if isinstance(found, dict) and isinstance(found.get("installation"), dict):
            return found["installation"]
    return None


def _installation_text(record: dict[str, Any]) -> str:
    return describe(record, ("torch", "transformers"))


def _drawn(key: str, build: Callable[[], Section]) -> Section:
    """A section, or the section saying which damaged input kept it from being drawn (the blocks inside the
    sections guard their own inputs; this is for what they read whole, like dedup's decisions)."""
    try:
        return build()
    except AssayError as exc:
        section = Section(key)
        section.damaged("an input of this section", str(exc))
        return section


def build_report(inputs: ReportInputs, out: str | Path, examples_per_reason: int = 3) -> dict[str, Any]:
    """Write OUT/index.html and OUT/why/*.txt; returns a summary (sections, charts, missing inputs)."""
    import plotly.offline

    if examples_per_reason < 0:
        raise AssayError(f"examples per reason must be >= 0, got {examples_per_reason}")
    out = Path(out)
    require_report_out(inputs, out)
    require_stage_outputs(inputs)
    out.mkdir(parents=True, exist_ok=True)
    tier2_damage = None
    try:
        thresholds, dropped = dynamic_thresholds(inputs.curated)
    except AssayError as exc:  # drawn without tier 2's thresholds and drops; the sections that use them say so
        thresholds, dropped, tier2_damage = {}, set(), str(exc)
    builders: list[tuple[str, Callable[[], Section]]] = [
        ("inputs", lambda: _head_section(inputs)),
        ("flow", lambda: _flow_section(inputs)),
        ("scores", lambda: _scores_section(inputs, thresholds, dropped, tier2_damage)),
        ("code-ratio", lambda: _labelled_section(inputs)),
        ("clusters", lambda: _dedup_section(inputs)),
        ("curves", lambda: _curves_section(inputs, dropped, tier2_damage)),
        ("lineage", lambda: _lineage_section(inputs)),
    ]
    if examples_per_reason:
        builders.append(("examples", lambda: _examples_section(inputs, out, examples_per_reason)))
    sections = [_drawn(key, build) for key, build in builders]
    created = datetime.now(timezone.utc).isoformat(timespec="seconds")
    nav = "".join(f'<a href="#{s.key}">{html.escape(s.title.split(",")[0])}</a>' for s in sections)
    body = "".join(f'<section id="{s.key}"><h2>{html.escape(s.title)}</h2>{"".join(s.parts)}</section>' for s in sections)
    page = (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>Assay report</title>'
            f"<style>{CSS}</style><script>{plotly.offline.get_plotlyjs()}</script></head><body>"
            f"<h1>Assay report</h1><p>Written {created} by <code>assay report</code>; works offline.</p>"
            f"<nav>{nav}</nav>{body}</body></html>")
    atomic_write_bytes(out / PAGE, page.encode("utf-8"))
    summary = {"format": REPORT_FORMAT, "page": str(out / PAGE), "created_at": created, "bytes": len(page.encode("utf-8")),
               "sections": {s.key: {"title": s.title, "charts": s.charts,
                                    "missing": sum('class="missing"' in p for p in s.parts),
                                    "damaged": sum('class="damaged"' in p for p in s.parts)} for s in sections},
               "charts": [c for s in sections for c in s.charts]}
    atomic_write_json(out / "summary.json", summary)
    return summary
