"""The `assay` command line.

Errors the user can act on print one line and exit 1; anything else is a bug
and prints one line too, with the traceback only under --debug.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Optional

import typer

from assay.errors import AssayError

_DEBUG = False

app = typer.Typer(
    name="assay",
    help=(
        "Assay: versioned, filtered pre-training data, closed-loop with training.\n\n"
        "Typical run: `assay ingest demo --out data/raw`, then `assay stats data/raw`. "
        "The whole pipeline runs with `dvc repro` (see README.md)."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


@app.callback()
def _root(
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks for errors."),
    params: Optional[Path] = typer.Option(
        None, "--params", help="params.yaml to use (default: ./params.yaml or a parent's, else built-in defaults)."
    ),
) -> None:
    if params is not None:
        os.environ["ASSAY_PARAMS"] = str(params)


def _params_file() -> Optional[str]:
    return os.environ.get("ASSAY_PARAMS")


class _OneLineErrors(logging.Filter):
    """Prefect logs a failed run's traceback to the console; the CLI promises
    one line per error, so the console shows the message without the
    traceback (the Prefect API and UI still receive it in full)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info:
            record.exc_info = None
            record.exc_text = None
        return True


def _quiet_console_tracebacks() -> None:
    if _DEBUG:
        return
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, _OneLineErrors) for f in handler.filters):
            handler.addFilter(_OneLineErrors())


@app.command()
def ingest(
    sources: list[str] = typer.Argument(
        ...,
        metavar="SOURCE...",
        help="Directories, .jsonl/.jsonl.gz or .parquet files, hf:PATH[:split] datasets, or `demo`.",
    ),
    out: Path = typer.Option(..., "--out", "-o", help="Output dataset directory."),
    text_field: Optional[str] = typer.Option(None, help="Record field holding the text [params: ingest.text_field]."),
    id_field: Optional[str] = typer.Option(None, help="Record field holding the id; derived from source and line when absent [params: ingest.id_field]."),
    source: Optional[str] = typer.Option(None, "--source", help="Source name for every document (default: the SOURCE's base name)."),
    overwrite: bool = typer.Option(False, help="Replace OUT when it holds a dataset of other inputs."),
    json_output: bool = typer.Option(False, "--json", help="Print the manifest as JSON."),
) -> None:
    """Read SOURCEs into a raw dataset: sharded Parquet, decisions, quarantine and a manifest.

    Bad input (invalid UTF-8, binary, empty, too large, malformed JSON, unreadable)
    is quarantined with a reason and counted; it never stops the run. Rerunning
    after a crash resumes: finished files are not read again.
    """
    from assay import report
    from flows.ingest import run_ingest

    _quiet_console_tracebacks()
    manifest = run_ingest(
        sources, str(out), text_field=text_field, id_field=id_field, source_name=source,
        overwrite=overwrite, params_file=_params_file(),
    )
    report.as_json(manifest) if json_output else report.ingest_summary(manifest)


run_app = typer.Typer(help="Run one pipeline stage on a dataset (each is a Prefect flow).", no_args_is_help=True)
quality_app = typer.Typer(help="Tier 1's quality head: train and evaluate it.", no_args_is_help=True)
app.add_typer(run_app, name="run")
app.add_typer(quality_app, name="quality")


@run_app.command("static")
def run_static(
    input_dir: Path = typer.Option(..., "--in", help="Input dataset (for example data/raw)."),
    out: Path = typer.Option(..., "--out", "-o", help="Output dataset directory."),
    overwrite: bool = typer.Option(False, help="Replace OUT when it holds a dataset of other inputs."),
    json_output: bool = typer.Option(False, "--json", help="Print the manifest as JSON."),
) -> None:
    """Tier 1: heuristics (Gopher, C4, FineWeb) on text, then the encoder's quality score.

    Every surviving document is embedded once (OUT/embeddings/); text keeps
    when quality >= static.threshold. Needs a trained head (`assay quality train`)
    unless static.model names a sequence classifier.
    """
    from assay import report
    from flows.static import run_static as run

    _quiet_console_tracebacks()
    manifest = run(str(input_dir), str(out), overwrite=overwrite, params_file=_params_file())
    report.as_json(manifest) if json_output else report.stage_summary(manifest)


@run_app.command("domain")
def run_domain(
    input_dir: Path = typer.Option(..., "--in", help="Input dataset (for example data/static)."),
    out: Path = typer.Option(..., "--out", "-o", help="Output dataset directory."),
    overwrite: bool = typer.Option(False, help="Replace OUT when it holds a dataset of other inputs."),
    json_output: bool = typer.Option(False, "--json", help="Print the manifest as JSON."),
) -> None:
    """Tier 3 on code: language ID, The Stack v2 rules, tree-sitter parsing, the domain model's perplexity.

    Text passes through untouched. Prints per-rule drop counts and the
    rule-clean share before and after. Needs the domain model
    (`assay domain train`) unless domain.model.model names another causal LM.
    """
    from assay import report
    from flows.domain import run_domain as run

    _quiet_console_tracebacks()
    manifest = run(str(input_dir), str(out), overwrite=overwrite, params_file=_params_file())
    report.as_json(manifest) if json_output else report.stage_summary(manifest)


@run_app.command("dedup")
def run_dedup(
    input_dir: Path = typer.Option(..., "--in", help="Input dataset (for example data/domain)."),
    out: Path = typer.Option(..., "--out", "-o", help="Output dataset directory (also holds the local vector store)."),
    overwrite: bool = typer.Option(False, help="Replace OUT when it holds a dataset of other inputs."),
    json_output: bool = typer.Option(False, "--json", help="Print the manifest as JSON."),
) -> None:
    """Exact, near-duplicate (MinHash LSH) and semantic (SemDeDup) dedup, global across shards.

    Reuses tier 1's stored embeddings (found upstream by manifest); upserts the
    knowledge graph (Document, Source, Cluster) into the vector store.
    """
    from assay import report
    from flows.dedup import run_dedup as run

    _quiet_console_tracebacks()
    manifest = run(str(input_dir), str(out), overwrite=overwrite, params_file=_params_file())
    report.as_json(manifest) if json_output else report.stage_summary(manifest)


def _store(data: Path):
    from assay.config import load_params
    from assay.shards import require_dataset
    from assay.vectors import open_store

    require_dataset(data)
    return open_store(load_params(_params_file()).vectors, data)


DATA_OPTION = typer.Option(Path("data/dedup"), "--data", help="The dedup output that holds the graph.")


@app.command()
def query(
    text: str = typer.Argument(..., help="Text to search for."),
    k: int = typer.Option(10, "-k", help="How many neighbours."),
    data: Path = DATA_OPTION,
    status: Optional[str] = typer.Option(None, help="Only documents with this status (kept, near_dup, ...)."),
    json_output: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Nearest documents to TEXT (embedded with the shared encoder), with score, source and status."""
    from assay import report
    from assay.config import load_params
    from assay.encoder import shared_encoder

    vector = shared_encoder(load_params(_params_file()).static.encoder).encode([text])[0]
    with _store(data) as store:
        hits = store.near(vector, k, where={"status": status} if status else None)
    report.hits(hits, json_output, exact=store.exact)


@app.command()
def similar(
    doc_id: str = typer.Argument(..., metavar="ID"),
    k: int = typer.Option(10, "-k", help="How many neighbours."),
    data: Path = DATA_OPTION,
    json_output: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Documents most similar to document ID (by its stored embedding)."""
    from assay import report

    with _store(data) as store:
        if store.get(doc_id) is None:
            raise AssayError(f"{doc_id}: not in the graph of {data}")
        hits = store.near_id(doc_id, k)
    report.hits(hits, json_output, exact=store.exact)


@app.command()
def cluster(
    doc_id: str = typer.Argument(..., metavar="ID"),
    data: Path = DATA_OPTION,
    json_output: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """The members of ID's duplicate clusters (near and semantic), with their status."""
    from assay import report

    with _store(data) as store:
        if store.get(doc_id) is None:
            raise AssayError(f"{doc_id}: not in the graph of {data}")
        result = {c.cluster_id: [dataclasses_as_dict(store.get(m)) for m in store.cluster_members(c.cluster_id)]
                  for c in store.clusters_of(doc_id)}
    report.clusters(doc_id, result, json_output)


@app.command()
def sources(
    overlap: bool = typer.Option(False, "--overlap", help="Which sources share duplicate clusters, and how much."),
    data: Path = DATA_OPTION,
    json_output: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Sources in the graph; with --overlap, the pairs of sources that share duplicate clusters."""
    from assay import report

    if not overlap:
        raise AssayError("only `assay sources --overlap` is available")
    with _store(data) as store:
        rows = store.source_overlap()
    report.overlap(rows, json_output)


@app.command()
def graph(
    doc_id: str = typer.Argument(..., metavar="ID"),
    data: Path = DATA_OPTION,
    json_output: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """ID's node in the knowledge graph: its source, clusters, what it duplicates and what duplicates it."""
    from assay import report

    with _store(data) as store:
        record = store.get(doc_id)
        if record is None:
            raise AssayError(f"{doc_id}: not in the graph of {data}")
        node = {**dataclasses_as_dict(record),
                "clusters": [f"{c.cluster_id} ({c.kind}, {c.size} members)" for c in store.clusters_of(doc_id)],
                "duplicated_by": store.duplicates_of(doc_id)}
    report.graph_node(node, json_output)


def dataclasses_as_dict(record) -> dict:
    import dataclasses

    if record is None:
        return {}
    data = dataclasses.asdict(record)
    data.pop("vector", None)
    return data


@quality_app.command("train")
def quality_train(
    data: Optional[Path] = typer.Option(None, "--data", help="Raw dataset: reference positives vs sampled negatives."),
    labels: Optional[Path] = typer.Option(None, "--labels", help="Labelled file (.jsonl/.csv/.parquet): `label` and `text` or `id`."),
    out: Path = typer.Option(Path("models/quality"), "--out", "-o", help="Where to save the head."),
    finetune: bool = typer.Option(False, help="Fine-tune the whole encoder with the head (slow on CPU)."),
    json_output: bool = typer.Option(False, "--json", help="Print the report as JSON."),
) -> None:
    """Train the quality head and report held-out AUC, precision/recall at the threshold, and calibration.

    Default recipe (GPT-3 / LLaMA): positives are the reference sources
    (quality.reference_sources), negatives are sampled from the rest of --data's text.
    """
    from assay import report
    from flows.quality import quality_train_flow

    _quiet_console_tracebacks()
    result = quality_train_flow(str(data) if data else None, str(out), labels=str(labels) if labels else None,
                                finetune=finetune, params_file=_params_file())
    report.as_json(result) if json_output else report.quality_report(result)


domain_app = typer.Typer(help="Tier 3's domain model: train it.", no_args_is_help=True)
app.add_typer(domain_app, name="domain")


@domain_app.command("train")
def domain_train(
    data: Path = typer.Option(..., "--data", help="Dataset holding the reference code (for example data/static)."),
    out: Path = typer.Option(Path("models/domain"), "--out", "-o", help="Where to save the model (save_pretrained)."),
    json_output: bool = typer.Option(False, "--json", help="Print the report as JSON."),
) -> None:
    """Train the small GPT-2-architecture code LM whose perplexity is tier 3's second screen.

    Reference code: domain.train.reference_sources / reference_langs that pass
    the code rules and parse. Any Hugging Face causal LM can replace it via
    domain.model.model.
    """
    from assay import report
    from flows.domain_model import domain_model_flow

    _quiet_console_tracebacks()
    result = domain_model_flow(str(data), str(out), params_file=_params_file())
    if json_output:
        report.as_json(result)


@app.command("train")
def train_command(
    data: Path = typer.Option(..., "--data", help="Dataset to train on (a DVC-tracked directory such as data/dedup, or any shard directory)."),
    out: Path = typer.Option(Path("runs/round-0"), "--out", "-o", help="Run directory: checkpoints, tokenizer, telemetry, metrics.json."),
    rev: Optional[str] = typer.Option(None, "--rev", help="Git rev whose committed version of --data to read through DVC (default: the workspace)."),
    resume: bool = typer.Option(False, "--resume", help="Continue the run in --out from its latest checkpoint."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Start again in a non-empty --out; a killed run of the same data and params is continued instead."),
    allow_data_change: bool = typer.Option(False, "--allow-data-change", help="With --resume: continue although --data is not the version the checkpoint was trained on."),
    steps: Optional[int] = typer.Option(None, "--steps", help="Override train.steps."),
    device: Optional[str] = typer.Option(None, "--device", help="cuda, xpu, mps, cpu or cuda:N (default: train.device, auto = cuda > xpu > mps > cpu)."),
    profile: bool = typer.Option(False, "--profile", help="Write a torch.profiler trace of steps 3-5 to OUT/profile/trace.json."),
    json_output: bool = typer.Option(False, "--json", help="Print metrics.json's content."),
) -> None:
    """Train the decoder LM (params.yaml: train) on an exact dataset version.

    Records, per document and step, its loss and gradient norm in OUT/telemetry
    (read back by the dynamic filter), skips loss / gradient-norm spikes (OLMo's
    6-sigma rule), checkpoints every train.checkpoint_every steps, and resumes
    bit-exactly on CPU.
    """
    from assay import report
    from flows.train import train_flow

    _quiet_console_tracebacks()
    metrics = train_flow(str(data), str(out), rev=rev, resume=resume, overwrite=overwrite,
                         allow_data_change=allow_data_change, steps=steps, device=device, profile=profile,
                         params_file=_params_file())
    if json_output:
        report.as_json(metrics)


@app.command()
def stats(
    data: Path = typer.Argument(..., metavar="DIR", help="A dataset directory."),
    json_output: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Documents, bytes and approximate tokens (bytes/4), by kind, lang and source."""
    from assay import report
    from assay.stats import dataset_stats

    result = dataset_stats(data)
    report.as_json(result) if json_output else report.stats_table(result)


@app.command()
def show(
    doc_id: str = typer.Argument(..., metavar="ID"),
    data: Path = typer.Option(..., "--data", help="The dataset directory to look in."),
    full: bool = typer.Option(False, help="Print the whole text, not the first 2,000 characters."),
    json_output: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Show one document (or its quarantine record) by id."""
    from assay import report
    from assay.lineage import find_document

    row = find_document(data, doc_id)
    if row is None:
        raise AssayError(f"{doc_id}: not in {data} (neither a document nor quarantined)")
    report.as_json(row) if json_output else report.document(row, full)


@app.command()
def why(
    doc_id: str = typer.Argument(..., metavar="ID"),
    data: list[Path] = typer.Option(..., "--data", help="Stage output directories; repeat the option for each."),
    json_output: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Every decision about a document across the given stage outputs, oldest first."""
    from assay import report
    from assay.lineage import why as story

    rows = story(doc_id, data)
    if json_output:
        report.as_json(rows)
    else:
        report.story(doc_id, rows)
    if not rows:
        raise typer.Exit(1)


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    # Prefect's temporary server needs more than its default 20 s to start on
    # a busy 2-core machine; waiting longer beats failing the run.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")
    global _DEBUG
    debug = _DEBUG = "--debug" in args or os.environ.get("ASSAY_DEBUG") == "1"
    try:
        app(args=args, prog_name="assay")
    except AssayError as exc:
        if debug:
            raise
        print(f"assay: error: {exc}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        print("assay: interrupted; rerun the same command to resume", file=sys.stderr)
        sys.exit(130)
    except Exception as exc:  # a bug: one line, unless the user asked for more
        if debug:
            raise
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        print(f"assay: internal error: {type(exc).__name__}: {message} (rerun with --debug for the traceback)", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
