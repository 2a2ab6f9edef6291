"""The `assay` command line.

Errors the user can act on print one line and exit 1; anything else is a bug
and prints one line too, with the traceback only under --debug.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
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
    traceback (the Prefect API and UI still receive it in full).

    A user's error (AssayError) the CLI prints itself, as its last line, so the
    console drops Prefect's ERROR line for it ("Encountered exception during
    execution: AssayError(...)") and the state line that repeats it.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info:
            if isinstance(record.exc_info[1], AssayError) or _disk_full(record.exc_info[1]):
                return False
            record.exc_info = None
            record.exc_text = None
        elif (record.name.startswith("prefect.") and "in state Failed" in str(record.msg)
              and any(said in record.getMessage() for said in _SAID_BY_THE_CLI)):
            return False
        return True


#: How a failed state names an error that the CLI prints as its own last line.
_SAID_BY_THE_CLI = ("AssayError", f"[Errno {errno.ENOSPC}]", f"[Errno {errno.EDQUOT}]")


def _disk_full(exc: BaseException | None) -> bool:
    """The machine's error, not a bug: the CLI says so in one line, and what to do."""
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)


def _quiet_console_tracebacks() -> None:
    if _DEBUG:
        return
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, _OneLineErrors) for f in handler.filters):
            handler.addFilter(_OneLineErrors())


#: The signals that stopped the command (SIGINT, SIGTERM, SIGHUP), and whether it runs flows.
_STOPPED_BY: list[int] = []
_RUNS_FLOWS = False


def _prepare_flow_run() -> None:
    """Before a command runs a flow: one-line errors on the console, and Prefect's temporary
    server (started by Prefect at the flow's first call, when PREFECT_API_URL names none) tied to
    this command: see `assay.prefect_server.tie_temporary_server`."""
    global _RUNS_FLOWS
    _RUNS_FLOWS = True
    _quiet_console_tracebacks()
    from assay.prefect_server import tie_temporary_server

    tie_temporary_server()


def _require_data_early(data: Path, rev: str | None) -> None:
    """A workspace --data that is no dataset, said before Prefect's temporary server starts (it took
    17-21 s to say `--data /nonexistent` under load; a probe, 2026-12-07). At a --rev, the flow reads
    it through DVC, and it need not be in the workspace."""
    if rev is None:
        from assay.shards import require_dataset

        require_dataset(data)


def _stop(signum: int, frame) -> None:
    """SIGINT, SIGTERM, SIGHUP: unwind as Ctrl-C does, so that Prefect records the run as crashed
    and the output's staging is left to resume; `main` then says so. (During a flow run Prefect
    catches SIGTERM itself, records the crash, and sends it again, which lands here.)"""
    _STOPPED_BY.append(signum)
    raise KeyboardInterrupt


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

    _prepare_flow_run()
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

    _prepare_flow_run()
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

    _prepare_flow_run()
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

    _prepare_flow_run()
    manifest = run(str(input_dir), str(out), overwrite=overwrite, params_file=_params_file())
    report.as_json(manifest) if json_output else report.stage_summary(manifest)


def _store(data: Path):
    from assay.config import load_params
    from assay.shards import require_dataset
    from assay.vectors import open_store

    require_dataset(data)
    return open_store(load_params(_params_file()).vectors, data, read_only=True)


DATA_OPTION = typer.Option(Path("data/dedup"), "--data", help="The dedup output that holds the graph.")


@app.command()
def query(
    text: str = typer.Argument(..., help="Text to search for."),
    k: int = typer.Option(10, "-k", min=1, help="How many neighbours."),
    data: Path = DATA_OPTION,
    status: Optional[str] = typer.Option(None, help="Only documents with this status (kept, near_dup, ...)."),
    json_output: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Nearest documents to TEXT (embedded with the shared encoder), with score, source and status."""
    from assay import report
    from assay.config import load_params
    from assay.encoder import shared_encoder
    from assay.stages.dedup import STATUSES

    # Any other status matches no document, and an empty table would read as "nothing similar"
    # rather than as a typo. "" is a typo too, not "no filter".
    if status is not None and status not in STATUSES:
        raise AssayError(f"--status {status!r}: not a document status; use one of {', '.join(STATUSES)}")
    if not text.strip():  # an empty text embeds to some vector all the same, and its "neighbours" mean nothing
        raise AssayError("query: TEXT is empty; give the words to search for")
    with _store(data) as store:  # opened first: a wrong --data is told before the encoder loads
        vector = shared_encoder(load_params(_params_file()).static.encoder).encode([text])[0]
        hits = store.near(vector, k, where={"status": status} if status is not None else None)
    report.hits(hits, json_output, exact=store.exact)


@app.command()
def similar(
    doc_id: str = typer.Argument(..., metavar="ID"),
    k: int = typer.Option(10, "-k", min=1, help="How many neighbours."),
    data: Path = DATA_OPTION,
    json_output: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Documents most similar to document ID (by its stored embedding)."""
    from assay import report

    with _store(data) as store:
        if store.get(doc_id, with_vector=False) is None:
            raise AssayError(f"{doc_id}: not in the graph of {data}")
        hits = store.near_id(doc_id, k)
    report.hits(hits, json_output, exact=store.exact)


@app.command()
def cluster(
    doc_id: str = typer.Argument(..., metavar="ID"),
    data: Path = DATA_OPTION,
    json_output: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """The members of ID's duplicate clusters (exact, near-duplicate and semantic), with their status."""
    from assay import report

    with _store(data) as store:
        if store.get(doc_id, with_vector=False) is None:
            raise AssayError(f"{doc_id}: not in the graph of {data}")
        result = {c.cluster_id: [dataclasses_as_dict(store.get(m, with_vector=False))
                                 for m in store.cluster_members(c.cluster_id)]
                  for c in store.clusters_of(doc_id)}
    report.clusters(doc_id, result, json_output)


@app.command()
def sources(
    overlap: bool = typer.Option(False, "--overlap", help="Which sources share duplicate clusters, and how much."),
    data: Path = DATA_OPTION,
    json_output: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Sources in the graph with their document counts; with --overlap, the pairs of sources that share
    duplicate clusters."""
    from assay import report

    with _store(data) as store:
        if overlap:
            report.overlap(store.source_overlap(), json_output)
        else:
            report.source_counts(store.source_counts(), str(data), json_output)


@app.command()
def graph(
    doc_id: str = typer.Argument(..., metavar="ID"),
    data: Path = DATA_OPTION,
    json_output: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """ID's node in the knowledge graph: its source, clusters, what it duplicates and what duplicates it."""
    from assay import report

    with _store(data) as store:
        record = store.get(doc_id, with_vector=False)
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

    _prepare_flow_run()
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

    _prepare_flow_run()
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
    steps: Optional[int] = typer.Option(None, "--steps", min=1, help="Override train.steps."),
    device: Optional[str] = typer.Option(None, "--device", help="cuda, xpu, mps, cpu or cuda:N (default: train.device, auto = cuda > xpu > mps > cpu)."),
    profile: bool = typer.Option(False, "--profile", help="Write a torch.profiler trace of steps 3-5 to OUT/profile/trace.json."),
    json_output: bool = typer.Option(False, "--json", help="Print metrics.json's content."),
    nproc: int = typer.Option(1, "--nproc", min=1, help="Ranks on this machine; above 1, they are launched as one group (every socket on 127.0.0.1; with --rdzv-endpoint, torchrun) and get one CPU thread each unless OMP_NUM_THREADS is set."),
    dp_replicate: Optional[int] = typer.Option(None, "--dp-replicate", min=1, help="DDP ranks (overrides train.parallel.dp_replicate)."),
    dp_shard: Optional[int] = typer.Option(None, "--dp-shard", help="FSDP2 (ZeRO-3) ranks; -1 = what the other dimensions leave."),
    tp: Optional[int] = typer.Option(None, "--tp", min=1, help="Tensor + sequence parallel ranks: heads and FFN units split over them (with --dp-shard: FSDP×TP)."),
    pp: Optional[int] = typer.Option(None, "--pp", min=1, help="Pipeline-parallel ranks (torch.distributed.pipelining; with --dp-shard/--dp-replicate: each stage data-parallel; with --tp, --ep or --cp too)."),
    pp_schedule: Optional[str] = typer.Option(None, "--pp-schedule", help="GPipe, 1F1B, Interleaved1F1B, InterleavedZeroBubble, ZBVZeroBubble or DualPipeV (overrides train.parallel.pp_schedule)."),
    pp_dynamic: Optional[bool] = typer.Option(None, "--pp-dynamic/--pp-static", help="Re-choose micro-batches each step from measured stage times and memory (train.parallel.pp_dynamic)."),
    cp: Optional[int] = typer.Option(None, "--cp", min=1, help="Context-parallel ranks: each row's sequence sharded (ring attention; sharded sparse attention)."),
    ep: Optional[int] = typer.Option(None, "--ep", min=1, help="Expert-parallel ranks: MoE experts sharded over the FSDP ranks (ep must divide --dp-shard; with --pp, over each stage's)."),
    zero1: Optional[bool] = typer.Option(None, "--zero1/--no-zero1", help="ZeRO-1: shard AdamW's state over the DDP ranks."),
    nnodes: str = typer.Option("1", "--nnodes", help="Machines (or MIN:MAX for elastic membership); needs --rdzv-endpoint."),
    rdzv_endpoint: Optional[str] = typer.Option(None, "--rdzv-endpoint", help="host:port of the rendezvous, the same on every node."),
    max_restarts: int = typer.Option(0, "--max-restarts", min=0, help="Restarts of the whole group after a rank fails, each resuming from the last checkpoint."),
) -> None:
    """Train the decoder LM (params.yaml: train) on an exact dataset version.

    Records, per document and step, its loss and gradient norm in OUT/telemetry
    (read back by the dynamic filter), skips loss / gradient-norm spikes (OLMo's
    6-sigma rule), checkpoints every train.checkpoint_every steps, and resumes
    bit-exactly on CPU.
    """
    _require_data_early(data, rev)  # before the imports: flows.train brings torch and Prefect (seconds)
    from assay import report
    from flows.train import train_flow

    _prepare_flow_run()
    layout = {k: v for k, v in {"dp_replicate": dp_replicate, "dp_shard": dp_shard, "tp": tp, "pp": pp, "cp": cp,
                                "ep": ep, "zero1": zero1, "pp_schedule": pp_schedule,
                                "pp_dynamic": pp_dynamic}.items() if v is not None}
    if nproc > 1 and profile:
        raise AssayError("--profile traces one process; run it without --nproc")
    if layout and nproc == 1 and nnodes == "1":
        # One process has no ranks to lay out: training it anyway would ignore what was asked.
        raise AssayError(f"--{next(iter(layout)).replace('_', '-')} lays out ranks; it needs --nproc above 1 "
                         "(or --nnodes)")
    metrics = train_flow(str(data), str(out), rev=rev, resume=resume, overwrite=overwrite,
                         allow_data_change=allow_data_change, steps=steps, device=device, profile=profile,
                         params_file=_params_file(), nproc=nproc, parallel=layout, nnodes=nnodes,
                         rdzv_endpoint=rdzv_endpoint, max_restarts=max_restarts)
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
    from assay.lineage import decisions_for, find_document

    row = find_document(data, doc_id)
    if row is None:
        dropped = [r for r in decisions_for(data, doc_id) if not r["kept"]]
        if dropped:  # the stage that made DATA judged it: say so, rather than "not in" alone
            raise AssayError(f"{doc_id}: not in {data}: its stage dropped it ({dropped[0]['reason']}); "
                             f"`assay why {doc_id} --data {data}` shows the decision")
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


# --- versions: dataset versions, diffs, releases, and the model export ---
def _print_json(obj) -> None:
    import json

    print(json.dumps(obj, indent=2, default=str))


REPO_OPTION = typer.Option(Path("."), "--repo", help="The git + DVC repository (default: the current directory).")


@app.command("versions")
def versions_command(
    repo: Path = REPO_OPTION,
    json_output: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Dataset versions: each commit that changed a data/ output, newest first, with documents per stage.

    Counts come from each output's manifest at that commit, read through DVC
    (cache, else the default remote); nothing is checked out.
    """
    from assay import report
    from assay.history import list_versions

    found = list_versions(repo)
    if json_output:
        _print_json([v.as_dict() for v in found])
        return
    report.versions(found, repo)


@app.command("diff")
def diff_command(
    rev_a: str = typer.Argument(..., metavar="REV_A", help="The older version (commit, tag, branch)."),
    rev_b: str = typer.Argument(..., metavar="REV_B", help="The newer version."),
    stage: Optional[str] = typer.Option(None, "--stage", help="Stage name or data path (default: the last data output of the pipeline)."),
    limit: int = typer.Option(20, "--limit", help="Documents listed (0: all); the counts by reason are always complete."),
    repo: Path = REPO_OPTION,
    json_output: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Documents added to and removed from a stage's dataset between two versions, with the reasons.

    A removed document's reason is the drop recorded in REV_B's decisions (by
    any stage); an added one's is why REV_A did not have it. Read through DVC
    at both revs; nothing is checked out.
    """
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from assay.history import diff_versions

    result = diff_versions(repo, rev_a, rev_b, stage=stage, limit=limit)
    if json_output:
        _print_json(result)
        return
    console = Console()
    console.print(f"{result['path']} (stage {result['stage']}): {result['documents_a']:,} documents at {rev_a} "
                  f"({result['commit_a'][:8]}) → {result['documents_b']:,} at {rev_b} ({result['commit_b'][:8]})")
    summary = Table(title=f"{result['removed']:,} removed, {result['added']:,} added",
                    caption=f"an added document's reason is why {rev_a} did not have it" if result["added"] else None)
    for name in ("change", "reason", "documents"):
        summary.add_column(name, justify="right" if name == "documents" else "left")
    for change in ("removed", "added"):
        for reason, n in result[f"{change}_by_reason"].items():
            summary.add_row(change, reason, f"{n:,}")
    console.print(summary)
    if result["rows"]:
        rows = Table()
        for name in ("change", "id", "reason", "dropped by", "detail"):
            rows.add_column(name, overflow="fold" if name == "id" else "ellipsis")  # ids whole, for `assay why`
        for row in result["rows"]:
            rows.add_row(row["change"], escape(row["id"]), escape(row["reason"]), row["dropped_by"] or "",
                         escape((row["detail"] or "")[:60]))
        console.print(rows)
    if result["rows_left_out"]:
        console.print(f"… {result['rows_left_out']:,} more (--limit 0 lists all, --json for machines)", style="dim")


@app.command("release")
def release_command(
    name: str = typer.Argument(..., metavar="NAME", help="The git tag to create, e.g. v1."),
    message: Optional[str] = typer.Option(None, "--message", "-m", help="The tag's message."),
    repo: Path = REPO_OPTION,
    json_output: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Release the committed version: `dvc push` to the default remote, then an annotated git tag NAME.

    Refused when tracked files have uncommitted changes, `dvc status` is not
    clean, the tag exists, or no default DVC remote is configured.
    """
    from assay.history import release

    result = release(repo, name, message)
    if json_output:
        _print_json(result)
        return
    print(f"tagged {name} at {result['commit'][:8]}; pushed {result['pushed']} file(s) to DVC remote "
          f"{result['remote']} ({result['url']})")
    print(f"share it: git push origin {name}; train on it: assay train --data {{DIR}} --rev {name}")


@app.command("export")
def export_command(
    run: Path = typer.Argument(..., metavar="RUN", help="A training run directory (for example runs/round-1)."),
    out: Path = typer.Option(..., "--out", "-o", help="Where to write the Hugging Face model."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace a non-empty OUT."),
    json_output: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Write a dense run's latest checkpoint as a Hugging Face LlamaForCausalLM with its tokenizer.

    Loads with AutoModelForCausalLM / AutoTokenizer.from_pretrained(OUT). The
    model card and config name the dataset version the run trained on.
    Sparse-attention and MoE runs are refused: no transformers class computes them.
    """
    from training.export import export_run

    result = export_run(run, out, overwrite=overwrite)
    if json_output:
        _print_json(result)
        return
    print(f"exported {result['run']} step {result['step']} ({result['parameters']:,} parameters) to {result['out']}")
    if not result["finished"]:
        print(f"note: {result['run']} has not finished (no metrics.json): this is an intermediate checkpoint, and "
              "its model card says so", file=sys.stderr)
    print(f"load: AutoModelForCausalLM.from_pretrained({str(result['out'])!r})")


# --- dynamic (tier 2) ---
@run_app.command("dynamic")
def run_dynamic(
    input_dir: Path = typer.Option(..., "--in", help="Input dataset (for example data/dedup)."),
    scores: Path = typer.Option(..., "--scores", help="The scoring pass's output (`assay score`, e.g. runs/round-0/scores)."),
    run: Path = typer.Option(..., "--run", help="The training run whose telemetry is read (e.g. runs/round-0)."),
    out: Path = typer.Option(..., "--out", "-o", help="Output dataset directory (e.g. data/curated)."),
    overwrite: bool = typer.Option(False, help="Replace OUT when it holds a dataset of other inputs."),
    allow_data_change: bool = typer.Option(False, "--allow-data-change", help="Judge --in although --scores were computed on another version of it (only the documents whose ids were scored are judged)."),
    json_output: bool = typer.Option(False, "--json", help="Print the manifest as JSON."),
) -> None:
    """Tier 2: drop documents by their training signals (params.yaml: dynamic).

    The primary signal is the alignment of a document's gradient with a clean
    reference set's; then loss (both ends) and gradient-norm outliers within
    kind x lang x length strata, non-finite values, documents that caused
    skipped steps or stood out on repeated draws, and RHO-LOSS's reducible
    loss when the scores have a reference model's loss. Every drop is recorded
    as dynamic:<signal> with its value and threshold.
    """
    from assay import report
    from flows.dynamic import run_dynamic as run_flow

    _prepare_flow_run()
    manifest = run_flow(str(input_dir), str(scores), str(run), str(out), overwrite=overwrite,
                        params_file=_params_file(), allow_data_change=allow_data_change)
    report.as_json(manifest) if json_output else report.stage_summary(manifest)


# --- report: the offline HTML page ---
@app.command("report")
def report_command(
    out: Path = typer.Option(Path("reports"), "--out", "-o", help="Directory for index.html and why/*.txt."),
    raw: Path = typer.Option(Path("data/raw"), "--raw", help="Ingest's output."),
    static: Path = typer.Option(Path("data/static"), "--static", help="Tier 1's output."),
    domain: Path = typer.Option(Path("data/domain"), "--domain", help="Tier 3's output."),
    dedup: Path = typer.Option(Path("data/dedup"), "--dedup", help="Dedup's output."),
    curated: Path = typer.Option(Path("data/curated"), "--curated", help="Tier 2's output."),
    round0: Path = typer.Option(Path("runs/round-0"), "--round0", help="Round 0's run (history, telemetry, scores/)."),
    round1: Path = typer.Option(Path("runs/round-1"), "--round1", help="Round 1's run."),
    models: Path = typer.Option(Path("models"), "--models", help="Models directory (models/domain)."),
    labelled: Path = typer.Option(Path("bench/labelled_code.json"), "--labelled", help="Tier 3's labelled-set measurement (JSON)."),
    repo: Path = typer.Option(Path("."), "--repo", help="The git + DVC repository whose versions are the lineage."),
    examples: int = typer.Option(3, "--examples", help="Example documents per drop reason (0: none)."),
    measure_labelled: bool = typer.Option(False, "--measure-labelled", help="First measure tier 3 on the labelled set with models/domain and write --labelled (1-2 min of CPU on 2 cores)."),
    json_output: bool = typer.Option(False, "--json", help="Print the report's summary as JSON."),
) -> None:
    """One static HTML page that works offline: kept and dropped per tier and reason, score histograms
    with thresholds, the effective-code ratio, duplicate clusters, both rounds' loss curves, the version
    lineage, and example drops linked to their `assay why` story.

    Every missing input makes its section say so and how to produce it.
    """
    from assay import report
    from assay.report_html import ReportInputs, require_stage_outputs
    from flows.report import report_flow

    # Before the flow: a stage option given another stage's output is one line, without a Prefect run.
    require_stage_outputs(ReportInputs(raw, static, domain, dedup, curated, round0, round1, models, labelled, repo))
    _prepare_flow_run()
    summary = report_flow(str(out), str(raw), str(static), str(domain), str(dedup), str(curated), str(round0),
                          str(round1), str(models), str(labelled), str(repo), examples, measure_labelled,
                          _params_file())
    if json_output:
        report.as_json(summary)


# --- ui: the Prefect server and UI, and the deployments it runs ---
@app.command("ui")
def ui_command(
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (the UI has no login: keep it local)."),
    port: int = typer.Option(4200, "--port", help="Port of the UI and its API."),
) -> None:
    """Start a local Prefect server with its UI and keep it running until Ctrl-C.

    Prints the address and the `export PREFECT_API_URL=...` line: with it, every
    assay command records its runs there and skips starting a temporary server.
    """
    import time

    from assay.prefect_server import start_server

    # SIGTERM and SIGHUP end the wait below as Ctrl-C does (`main` installs `_stop` for all three,
    # also over the SIGINT a shell leaves ignored for `assay ui &`), so the server, in a session of
    # its own and out of the terminal's reach, is stopped too.
    started = time.monotonic()
    print(f"starting the Prefect server on {host}:{port} ...", file=sys.stderr, flush=True)
    server = start_server(host, port)
    try:
        # Inside the try: a signal can land while the address is written (a slow reader, a loaded machine),
        # and the server is up by then, so it is stopped as at any later moment.
        print(f"Prefect UI: {server.address}  (ready in {time.monotonic() - started:.1f} s; server log {server.log})\n"
              f"In other terminals, to use it:\n  export PREFECT_API_URL={server.url}\n"
              f"then `assay serve` in the repository to run stages and the pipeline from the UI. Ctrl-C stops.",
              flush=True)
        while server.process.poll() is None:
            time.sleep(0.5)
        raise AssayError(f"the Prefect server stopped by itself (code {server.process.returncode}); see {server.log}")
    except KeyboardInterrupt:
        _STOPPED_BY.clear()  # a signal is how this command is meant to end: handled here, exit 0
        print("stopping the Prefect server ...", file=sys.stderr, flush=True)
    finally:
        server.stop()
    print("stopped", file=sys.stderr)


@app.command("serve")
def serve_command(
    pipeline_only: bool = typer.Option(False, "--pipeline-only", help="Serve only the end-to-end pipeline flow."),
    name: str = typer.Option("assay", "--name", help="Deployment name (the UI shows FLOW/NAME)."),
    limit: int = typer.Option(1, "--limit", help="Runs at a time; more queue (stages share outputs and DVC locks the repository). 0: no limit."),
) -> None:
    """Serve deployments of every stage flow and of the pipeline flow to the server at PREFECT_API_URL.

    Press Run in the UI (or POST /api/deployments/ID/create_flow_run) and the run
    executes here, in this repository. The `pipeline` deployment runs `dvc repro`
    stage by stage, so dvc.lock records what it produced. Needs `assay ui` running.
    """
    from flows.serve import serve

    _quiet_console_tracebacks()
    serve(pipeline_only=pipeline_only, name=name, limit=limit or None, params_file=_params_file())


# --- score (tier 2's scoring pass) ---
@app.command("score")
def score_command(
    run: Path = typer.Option(..., "--run", help="Run directory of the checkpoint(s) and tokenizer (e.g. runs/round-0)."),
    data: Path = typer.Option(..., "--data", help="Dataset whose every document is scored (e.g. data/dedup)."),
    out: Path = typer.Option(..., "--out", "-o", help="Output directory: part-*.parquet (SCORE_SCHEMA), reference.txt, manifest.json."),
    rev: Optional[str] = typer.Option(None, "--rev", help="Git rev whose committed version of --data to read through DVC (default: the workspace)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace scores of other inputs or params in --out (a killed run of the same inputs is resumed either way)."),
    checkpoint: Optional[list[str]] = typer.Option(None, "--checkpoint", metavar="STEP", help="Checkpoint step to score, or 'last'; repeat for several (default: score.checkpoints)."),
    device: Optional[str] = typer.Option(None, "--device", help="cuda, xpu, mps, cpu or cuda:N (default: score.device)."),
    json_output: bool = typer.Option(False, "--json", help="Print the manifest."),
) -> None:
    """Score every document of a dataset with a run's checkpoint (params.yaml: score).

    One forward and one backward per batch, no optimizer step, rows exactly as in
    training (each document's first score.max_rows rows): per document its loss, the
    norm of its gradient and that gradient's cosine with the gradient of the clean
    reference set (score.reference; ids in OUT/reference.txt, never judged), per
    stratum (score.strata). Resumable: a rerun redoes only missing parts. Read the
    result with training.score.read_scores or `assay run dynamic --scores OUT`.
    """
    _require_data_early(data, rev)  # before the imports: flows.score brings torch and Prefect (seconds)
    from assay import report
    from flows.score import score_flow

    steps = None
    if checkpoint:
        try:
            steps = [c if c == "last" else int(c) for c in checkpoint]
        except ValueError:
            raise AssayError(f"--checkpoint takes a step number or 'last', not {checkpoint}") from None
    _prepare_flow_run()
    manifest = score_flow(str(run), str(data), str(out), rev=rev, overwrite=overwrite, checkpoints=steps,
                          device=device, params_file=_params_file())
    if json_output:
        report.as_json(manifest)


def environment_defaults() -> None:
    """Assay's defaults for settings of the tools it runs; a value the environment sets wins."""
    # Prefect's temporary server needs more than its default 20 s to start on
    # a busy 2-core machine; waiting longer beats failing the run.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")
    # Prefect's servers (the temporary one of each run, `assay ui`'s) send usage telemetry unless told
    # not to: a data tool sends nothing from the user's machine unasked, and offline the attempt logged
    # "ERROR ... Failed to send telemetry" in every run.
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    global _DEBUG
    # Only an option: after "--" the word is an argument (a query text or an id), not --debug.
    options = args[:args.index("--")] if "--" in args else args
    debug = _DEBUG = "--debug" in options or os.environ.get("ASSAY_DEBUG") == "1"
    environment_defaults()
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _stop)
    try:
        app(args=args, prog_name="assay")
    except (KeyboardInterrupt, SystemExit) as exc:
        if not _STOPPED_BY:  # typer's own exit, 0 or a usage error's 2
            raise
        _stopped(_STOPPED_BY[0], exc)
    except AssayError as exc:
        if debug:
            raise
        print(f"assay: error: {_printable(str(exc))}", file=sys.stderr)
        sys.exit(1)
    except Exception as exc:  # a bug: one line, unless the user asked for more
        if debug:
            raise
        if str(exc).startswith("Failed to reach API"):  # PREFECT_API_URL names a server that is down
            print(f"assay: error: no Prefect server answers at PREFECT_API_URL={os.environ.get('PREFECT_API_URL')}: "
                  "start one with `assay ui`, or unset PREFECT_API_URL to use a temporary one", file=sys.stderr)
            sys.exit(1)
        if _disk_full(exc):
            where = f" writing {exc.filename}" if exc.filename else ""
            print(f"assay: error: the disk is full ({os.strerror(exc.errno)}{where}): free space and rerun the same "
                  "command; nothing half-written was published, and a stage resumes the units it finished (a "
                  "training run, its last checkpoint)", file=sys.stderr)
            sys.exit(1)
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        print(f"assay: internal error: {type(exc).__name__}: {_printable(message)} (rerun with --debug for the traceback)",
              file=sys.stderr)
        sys.exit(2)


def _printable(message: str) -> str:
    """`message` with its control characters escaped (ESC as the four characters \\x1b): errors quote ids, paths and
    values as the user gave them, and an escape sequence among them would restyle or rewrite the
    terminal rather than show what was wrong. Tabs and line ends stay."""
    return "".join(f"\\x{ord(c):02x}" if (ord(c) < 32 and c not in "\t\n") or 127 <= ord(c) < 160 else c
                   for c in message)


def _stopped(signum: int, exc: BaseException) -> None:
    """End a command a signal stopped: one line, and the shell's code for that signal (130, 143).

    Ended at once with os._exit: a stage's worker threads may still be inside a unit, which a
    normal exit would wait for; what they leave is what a kill leaves, which the rerun redoes.
    The temporary server is stopped first, so that its own last lines come before ours (it would
    get SIGTERM as this process ends anyway: `tie_temporary_server`).
    """
    from assay.prefect_server import stop_temporary_server

    name = signal.Signals(signum).name
    stop_temporary_server()
    if _DEBUG:
        import traceback

        traceback.print_exception(exc)
    if _RUNS_FLOWS:
        print(f"assay: stopped by {name}; what was finished is kept, and nothing half-written was published: "
              "rerun the same command to resume", file=sys.stderr)
    else:
        print(f"assay: stopped by {name}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(128 + signum)

if __name__ == "__main__":
    main()
