"""`assay report`: the offline HTML page, rendered from a small real pipeline and drawn by headless Chromium.

The pipeline (ingest → … → train, by `dvc repro train` in a temporary git
repo) is real; tier 2's scoring pass and curated dataset are built here in
the contract's schema (docs/issue11-contracts: SCORE_SCHEMA and the dynamic
dataset layout), because their stages are written in parallel; round 1 is a
real training run on that curated dataset.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import string
import subprocess
import sys
import textwrap
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import yaml

from assay.errors import AssayError
from assay.report_html import CHART_CLASS, ReportInputs, build_report, duplicate_clusters, why_stories
from assay.schema import DECISION_SCHEMA
from corpus import tiny_pipeline_params
from dvc_repo import dvc_repo, git_env
from assay.shards import ShardWriter, iter_batches, list_shards, write_manifest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
CHROMIUM = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)
PIPELINE_STAGES = ("ingest", "quality-head", "static", "domain-model", "domain", "dedup", "train")


def _run(cmd, cwd, env, timeout=900):
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def _tiny_params() -> dict:
    return tiny_pipeline_params(ROOT / "params.yaml")


# --- tier 2's outputs, in the contract's schema -------------------------------------------------------------------

SCORE_COLUMNS = pa.schema([
    pa.field("step", pa.int64(), nullable=False), pa.field("sample_id", pa.string(), nullable=False),
    pa.field("kind", pa.string()), pa.field("lang", pa.string()), pa.field("tokens", pa.int32()),
    pa.field("loss", pa.float32()), pa.field("grad_norm", pa.float32()), pa.field("grad_dot", pa.float32()),
    pa.field("alignment", pa.float32()), pa.field("stratum", pa.string()), pa.field("ref_loss", pa.float32()),
    pa.field("order_rise", pa.float32()), pa.field("reference", pa.bool_()),
])
ALIGNMENT_THRESHOLD = 0.0


def _unit(doc_id: str) -> float:
    return int(hashlib.blake2b(doc_id.encode(), digest_size=4).hexdigest(), 16) / 2**32


def write_tier2(repo: Path, step: int) -> set[str]:
    """runs/round-0/scores and data/curated as the score and dynamic stages lay them out; returns the dropped ids."""
    docs = pa.concat_tables(pa.Table.from_batches([b]) for b in iter_batches(repo / "data/dedup", columns=["id", "kind", "lang"]))
    ids = docs.column("id").to_pylist()
    rng = np.random.default_rng(0)
    n = len(ids)
    reference = np.array([_unit(i) < 0.15 for i in ids])
    alignment = rng.normal(0.05, 0.06, n).astype(np.float32)
    scores = pa.table({
        "step": pa.array([step] * n, pa.int64()), "sample_id": ids, "kind": docs.column("kind"), "lang": docs.column("lang"),
        "tokens": pa.array(rng.integers(10, 300, n), pa.int32()),
        "loss": pa.array(rng.normal(5.5, 0.6, n), pa.float32()), "grad_norm": pa.array(rng.lognormal(-1, 0.3, n), pa.float32()),
        "grad_dot": pa.array(alignment * 0.5, pa.float32()), "alignment": pa.array(alignment),
        "stratum": docs.column("kind"), "ref_loss": pa.nulls(n, pa.float32()),
        "order_rise": pa.array(rng.normal(0.12, 0.04, n), pa.float32()), "reference": pa.array(reference),
    }, schema=SCORE_COLUMNS)
    out = repo / "runs/round-0/scores"
    out.mkdir(parents=True)
    pq.write_table(scores, out / "part-00000.parquet")
    write_manifest(out, {"format": "assay-scores/1", "rows": n})

    judged = ~reference
    drop = judged & (alignment < ALIGNMENT_THRESHOLD)
    reasons = [("dynamic:alignment" if d else None) for d in drop]
    maps = [([("alignment", float(a)), ("alignment_threshold", ALIGNMENT_THRESHOLD)] if j else None)
            for a, j in zip(alignment, judged)]
    curated = repo / "data/curated"
    decisions = pa.table({"id": ids, "stage": ["dynamic"] * n, "kept": pa.array(~drop), "reason": pa.array(reasons, pa.string()),
                          "scores": pa.array(maps, DECISION_SCHEMA.field("scores").type),
                          "detail": pa.array([None if j else "not scored" for j in judged], pa.string())},
                         schema=DECISION_SCHEMA)
    (curated / "decisions").mkdir(parents=True)
    pq.write_table(decisions, curated / "decisions/part-00000.parquet")
    dropped = {i for i, d in zip(ids, drop) if d}
    for shard in list_shards(repo / "data/dedup"):
        table = pq.read_table(shard)
        keep = pc.invert(pc.is_in(table.column("id"), value_set=pa.array(sorted(dropped), pa.string())))
        with ShardWriter(curated, table.schema, first_index=int(shard.stem.split("-")[1])) as writer:
            writer.write(table.filter(keep))
    write_manifest(curated, {"format": "assay-dataset/1", "stage": "dynamic", "created_at": "2099-01-01T00:00:00+00:00",
                             "counts": {"input": n, "kept": n - len(dropped), "dropped": len(dropped),
                                        "by_reason": {"dynamic:alignment": len(dropped)}}})
    return dropped


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    """A real tiny pipeline to round 0 under DVC (one committed version), tier 2's outputs, and a real round 1."""
    repo = tmp_path_factory.mktemp("report") / "repo"
    repo.mkdir()
    env = git_env()
    dvc_yaml = yaml.safe_load((ROOT / "dvc.yaml").read_text())
    dvc_yaml["stages"] = {k: v for k, v in dvc_yaml["stages"].items() if k in PIPELINE_STAGES}
    # Duplicates for dedup to find (the tiny demo has none): exact copies of one stdlib module, near copies of another.
    extra = repo / "extra"
    extra.mkdir()
    for i in range(3):
        shutil.copy(textwrap.__file__, extra / f"textwrap_copy{i}.py")
    source = Path(string.__file__).read_text()
    for i in range(2):
        (extra / f"string_edit{i}.py").write_text(source + f"\n# local edit {i}\n")
    dvc_yaml["stages"]["ingest"]["cmd"] = "assay ingest demo extra --out data/raw --overwrite"
    (repo / "dvc.yaml").write_text(yaml.safe_dump(dvc_yaml, sort_keys=False))
    params = _tiny_params()
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    dvc_repo(repo)
    _run(["git", "add", "-A"], repo, env)
    _run(["git", "commit", "-qm", "pipeline"], repo, env)
    _run([BIN / "dvc", "repro", "train"], repo, env)
    _run(["git", "add", "-A"], repo, env)
    _run(["git", "commit", "-qm", "data v1"], repo, env)
    _run(["git", "tag", "v1"], repo, env)
    dropped = write_tier2(repo, step=params["train"]["steps"])
    # Round 1 for real, on the curated data; a hair-trigger spike rule so that some steps are skipped.
    round1 = dict(params, train={**params["train"], "telemetry": {**params["train"]["telemetry"], "spike_sigma": 0.0,
                                                                 "spike_min_history": 2}})
    (repo / "params-round1.yaml").write_text(yaml.safe_dump(round1, sort_keys=False))
    _run([BIN / "assay", "--params", "params-round1.yaml", "train", "--data", "data/curated", "--out", "runs/round-1"],
         repo, env)
    return repo, env, dropped


# --- reading the drawn page ---------------------------------------------------------------------------------------

#: Elements Plotly draws for data: bars and markers (`point`), lines (`js-line`), Sankey links.
MARKS = ("point", "js-line", "sankey-link")


#: HTML's void elements: they have no end tag in the serialised DOM (SVG elements always do).
VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}


class _Charts(HTMLParser):
    """Per chart container (class assay-chart), how many data marks the browser drew inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[str | None] = []  # per open element, the chart it opens (None for most)
        self.marks: dict[str, int] = {}
        self.svgs: dict[str, int] = {}

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        classes = (attrs.get("class") or "").split()
        name = attrs.get("data-chart") if CHART_CLASS in classes else None
        if name:
            self.marks.setdefault(name, 0)
            self.svgs.setdefault(name, 0)
        current = name or next((c for c in reversed(self.stack) if c), None)
        if current:
            self.svgs[current] += tag == "svg" and "main-svg" in classes
            self.marks[current] += any(m in classes for m in MARKS)
        if tag not in VOID:
            self.stack.append(name)

    def handle_endtag(self, tag):
        if tag not in VOID and self.stack:
            self.stack.pop()


def drawn_charts(page: Path, tmp: Path) -> dict[str, int]:
    """Open `page` in headless Chromium with every host unresolvable (nothing can be fetched), let its scripts
    run, and count the data marks Plotly drew in each chart container."""
    dom = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--host-resolver-rules=MAP * ~NOTFOUND",
         f"--user-data-dir={tmp / 'chromium-profile'}", "--virtual-time-budget=20000", "--dump-dom", page.as_uri()],
        capture_output=True, text=True, timeout=300)
    assert dom.returncode == 0, dom.stderr[-2000:]
    parser = _Charts()
    parser.feed(dom.stdout)
    return {name: parser.marks[name] if parser.svgs[name] else 0 for name in parser.marks}


def screenshot(page: Path, png: Path, tmp: Path, height: int = 6000) -> None:
    done = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--host-resolver-rules=MAP * ~NOTFOUND",
         f"--user-data-dir={tmp / 'chromium-profile'}", "--virtual-time-budget=20000", f"--window-size=1400,{height}",
         f"--screenshot={png}", page.as_uri()], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and png.is_file(), done.stderr[-2000:]


# --- tests ---------------------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.skipif(CHROMIUM is None, reason="no chromium binary (Debian: apt-get install -y chromium): the page cannot be drawn")
def test_report_of_a_real_pipeline_draws_every_chart_offline(pipeline, tmp_path):
    repo, env, dropped = pipeline
    out = _run([BIN / "assay", "report", "--out", "reports", "--json"], repo, env)
    summary = json.loads(out[out.index("{"):])
    page = repo / "reports/index.html"
    html_text = page.read_text()

    # Offline: nothing is loaded from anywhere; plotly.js is inline.
    assert not re.search(r'<(script|link|img)[^>]+(src|href)="(https?:)?//', html_text)
    assert "<script>" in html_text and len(html_text) > 3_000_000

    # Every section that has its inputs drew its charts; the page lists them.
    expected = {"flow-sankey", "flow-bars", "score-quality", "score-loss", "score-grad_norm", "score-alignment",
                "score-order_rise", "cluster-sizes", "loss-curves", "lineage-counts"}
    assert expected <= set(summary["charts"]), summary["charts"]
    drawn = drawn_charts(page, tmp_path)
    assert set(drawn) == set(summary["charts"])
    assert all(n > 0 for n in drawn.values()), drawn

    # The same page without plotly.js draws nothing: the check above can fail.
    broken = tmp_path / "broken.html"
    broken.write_text(re.sub(r"<script>.*?</script></head>", "</head>", html_text, count=1, flags=re.S))
    assert set(drawn_charts(broken, tmp_path).values()) == {0}

    # What the sections say: round 1 is there (with its skipped steps), tier 2's threshold and drops are drawn.
    history = [json.loads(line) for line in (repo / "runs/round-1/history.jsonl").read_text().splitlines()]
    skipped = sum(1 for h in history if h["skipped"])
    assert skipped > 0 and f"round 1 skipped steps ({skipped})" in html_text
    assert f"dropped by tier 2 ({len(dropped)})" in html_text and "threshold 0" in html_text
    assert "Missing:" in html_text  # the labelled measurement is not there, and the section says how to make it
    assert "assay report --out reports/ --measure-labelled" in html_text

    # Dedup's clusters: the planted copies are in them, and every duplicate dropped is counted once.
    dedup = json.loads((repo / "data/dedup/manifest.json").read_text())["counts"]
    assert dedup["by_reason"].get("exact_dup", 0) >= 2
    assert f"{dedup['dropped']:,} duplicates were dropped" in html_text and "<code>exact_dup</code>" in html_text

    # Lineage: the committed version, its tag and its counts read through DVC.
    assert "v1</span>" in html_text
    raw_docs = json.loads((repo / "data/raw/manifest.json").read_text())["counts"]["documents"]
    assert f"{raw_docs:,} docs" in html_text

    # Each example links to a file that holds exactly what `assay why` prints.
    links = re.findall(r'href="why/([0-9a-f]+)\.txt"', html_text)
    assert links and all((repo / "reports/why" / f"{i}.txt").is_file() for i in links)
    example = next(i for i in links if i in dropped)  # one that tier 2 dropped: its story has five stages
    saved = (repo / "reports/why" / f"{example}.txt").read_text()
    datasets = ["data/raw", "data/static", "data/domain", "data/dedup", "data/curated"]
    printed = _run([BIN / "assay", "why", example, *[a for d in datasets for a in ("--data", d)]], repo, env)
    assert saved.split("\n", 1)[1] == printed
    assert "dynamic (data/curated): dropped dynamic:alignment" in printed

    png = tmp_path / "report.png"
    screenshot(page, png, tmp_path)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 50_000


@pytest.mark.slow
def test_bulk_why_matches_assay_why(pipeline):
    from assay.lineage import why

    repo, _, dropped = pipeline
    datasets = [repo / d for d in ("data/raw", "data/static", "data/domain", "data/dedup", "data/curated")]
    ids = sorted(dropped)[:3] + [pq.read_table(list_shards(repo / "data/raw/decisions")[0]).column("id")[0].as_py()]
    stories = why_stories(ids, datasets)
    for doc_id in ids:
        assert stories[doc_id] == why(doc_id, datasets)
        assert stories[doc_id]


def test_every_missing_input_is_said_with_the_command_that_makes_it(tmp_path):
    empty = tmp_path / "nothing"
    empty.mkdir()
    inputs = ReportInputs(*(empty / p for p in ("data/raw", "data/static", "data/domain", "data/dedup", "data/curated",
                                               "runs/round-0", "runs/round-1", "models", "labelled.json")), repo=empty)
    summary = build_report(inputs, tmp_path / "reports")
    page = (tmp_path / "reports/index.html").read_text()
    assert summary["charts"] == []
    for key in ("flow", "scores", "code-ratio", "clusters", "curves", "lineage", "examples"):
        assert summary["sections"][key]["missing"] >= 1, key
    for command in ("assay ingest demo --out data/raw", "assay run dedup --in data/domain --out data/dedup",
                    "assay score --run runs/round-0", "assay run dynamic --in data/dedup",
                    "assay train --data data/curated --out runs/round-1", "--measure-labelled", "git add dvc.lock"):
        assert command in page, command


def test_a_file_where_the_report_directory_should_be_is_a_clear_error(tmp_path):
    from assay.errors import AssayError

    (tmp_path / "reports").write_text("")
    with pytest.raises(AssayError, match="not a directory"):
        build_report(ReportInputs(repo=tmp_path), tmp_path / "reports")


def _dedup_decisions(directory: Path, rows: list[tuple[str, str | None, str | None]]) -> None:
    (directory / "decisions").mkdir(parents=True)
    table = pa.table({"id": [r[0] for r in rows], "stage": ["dedup"] * len(rows), "kept": [r[1] is None for r in rows],
                      "reason": pa.array([r[1] for r in rows], pa.string()), "scores": pa.nulls(len(rows), DECISION_SCHEMA.field("scores").type),
                      "detail": pa.array([f"duplicate of {r[2]}" if r[2] else None for r in rows], pa.string())},
                     schema=DECISION_SCHEMA)
    pq.write_table(table, directory / "decisions/part-00000.parquet")


def test_duplicate_clusters_follow_chains_and_name_their_kind(tmp_path):
    _dedup_decisions(tmp_path, [
        ("k1", None, None), ("a", "exact_dup", "k1"), ("b", "near_dup", "a"), ("c", "near_dup", "k1"),
        ("k2", None, None), ("d", "exact_dup", "k2"),
        ("k3", None, None), ("e", "semantic_dup", "k3"), ("f", "semantic_dup", "k3"),
        ("alone", None, None),
    ])
    assert sorted(duplicate_clusters(tmp_path)) == [(2, "exact_dup"), (3, "semantic_dup"), (4, "mixed")]


def test_the_labelled_measurement_is_drawn_and_a_stale_one_is_flagged(tmp_path):
    """The effective-code section reads measure_labelled_code's JSON (its format is fixed here)."""
    from assay.stages.shard_stage import file_fingerprint

    model = tmp_path / "models/domain"
    model.mkdir(parents=True)
    (model / "model.safetensors").write_bytes(b"weights")

    def rows(before_hand: float, after: float) -> list[dict]:
        return [{"name": n, "dropped": 3, "kept": 40, "kept_hand_share": after if n == "stage" else before_hand,
                 "generated_recall": 0.9, "hand_keep_rate": 0.97} for n in ("part:rules", "part:syntax", "part:screen", "stage")]

    measured = {"format": "assay-labelled-code/1", "model": str(model), "model_fingerprint": file_fingerprint(model),
                "languages": ["python"], "min_perplexity": 66.1, "created_at": "2026-12-01T00:00:00+00:00",
                "mixes": [{"share": 0.3, "files": 638, "generated": 191, "before": 0.701, "rows": rows(0.75, 0.977)}]}
    labelled = tmp_path / "labelled.json"
    labelled.write_text(json.dumps(measured))
    inputs = ReportInputs(models=tmp_path / "models", labelled=labelled, repo=tmp_path, raw=tmp_path / "none")
    summary = build_report(inputs, tmp_path / "reports", examples_per_reason=0)
    page = (tmp_path / "reports/index.html").read_text()
    assert "code-ratio" in summary["charts"] and summary["sections"]["code-ratio"]["missing"] == 0
    assert "<td>evaluation</td><td>30%</td><td>638</td><td>191</td><td>70.1%</td><td>97.7%</td><td>90.0%</td><td>97.0%</td>" in page

    (model / "model.safetensors").write_bytes(b"retrained")
    build_report(inputs, tmp_path / "reports", examples_per_reason=0)
    assert "Measured with another domain model" in (tmp_path / "reports/index.html").read_text()


def test_tier2_thresholds_belong_to_the_value_they_cut(tmp_path):
    """The dynamic stage's naming: `loss_z` beside `loss_z_high_threshold` and `loss_z_low_threshold`."""
    from assay.report_html import dynamic_thresholds

    rows = [("a", True, None, [("alignment", 0.3), ("alignment_threshold", 0.0), ("loss_z", 1.0),
                               ("loss_z_high_threshold", 3.5), ("loss_z_low_threshold", -3.5)]),
            ("b", False, "dynamic:loss_z_high", [("loss_z", 4.2), ("loss_z_high_threshold", 3.5),
                                                 ("loss_z_low_threshold", -3.5)])]
    (tmp_path / "decisions").mkdir()
    pq.write_table(pa.table({"id": [r[0] for r in rows], "stage": ["dynamic"] * 2, "kept": [r[1] for r in rows],
                             "reason": pa.array([r[2] for r in rows], pa.string()),
                             "scores": pa.array([r[3] for r in rows], DECISION_SCHEMA.field("scores").type),
                             "detail": pa.nulls(2, pa.string())}, schema=DECISION_SCHEMA),
                   tmp_path / "decisions/part-00000.parquet")
    thresholds, dropped = dynamic_thresholds(tmp_path)
    assert thresholds == {"alignment": {"threshold": [0.0]},
                          "loss_z": {"high threshold": [3.5], "low threshold": [-3.5]}}
    assert dropped == {"b"}


def test_a_document_id_never_names_a_file_outside_the_report():
    """Ids come from the input (--id-field): `../../../x` wrote the story outside --out."""
    from assay.report_html import why_file_name

    why = Path("/r/why")
    hex_id = "0123456789abcdef0123456789abcdef"
    assert why_file_name(hex_id) == f"{hex_id}.txt" and why_file_name("doc-7.v2") == "doc-7.v2.txt"
    hostile = ["../../../ESCAPED", "sub/dir/x", "..", ".hidden", "a" * 300, "x\\y", "", "nul\x00id", "\udcff"]
    names = [why_file_name(i) for i in hostile]
    for name in names:
        assert "/" not in name and "\\" not in name and not name.startswith(".") and len(name) < 255
        assert (why / name).resolve().parent == why
    assert len(set(names)) == len(names)  # distinct ids, distinct files


def test_a_stage_option_given_another_stages_output_is_refused(tmp_path):
    """`assay report --static data/raw` drew ingest's decisions as tier 1's, labelled tier 1."""
    from assay.errors import AssayError

    raw = tmp_path / "data/raw"
    (raw / "decisions").mkdir(parents=True)
    ingest_rows = pa.table({"id": ["a", "b"], "stage": ["ingest"] * 2, "kept": [True, False],
                            "reason": pa.array([None, "invalid:json"], pa.string()),
                            "scores": pa.nulls(2, DECISION_SCHEMA.field("scores").type),
                            "detail": pa.nulls(2, pa.string())}, schema=DECISION_SCHEMA)
    pq.write_table(ingest_rows, raw / "decisions/part-00000.parquet")
    write_manifest(raw, {"format": "assay-dataset/1", "stage": "ingest",
                         "counts": {"input_records": 2, "documents": 1}})
    bare = tmp_path / "bare"  # decisions without a manifest: their own `stage` says who made them
    shutil.copytree(raw / "decisions", bare / "decisions")
    nothing = tmp_path / "nothing"
    base = dict(raw=raw, static=nothing, domain=nothing, dedup=nothing, curated=nothing, round0=nothing, round1=nothing,
                models=nothing, labelled=nothing / "labelled.json", repo=tmp_path)
    for field, given, wanted in (("static", raw, "static"), ("curated", bare, "dynamic"), ("raw", bare, None)):
        inputs = ReportInputs(**{**base, field: given})
        if wanted is None:  # ingest's output where ingest's is asked for
            build_report(inputs, tmp_path / "reports", examples_per_reason=0)
            continue
        with pytest.raises(AssayError, match=f"made by stage 'ingest', not '{wanted}': --{field} takes"):
            build_report(inputs, tmp_path / "refused", examples_per_reason=0)
        assert not (tmp_path / "refused").exists()
    proc = subprocess.run([BIN / "assay", "report", "--static", raw, "--raw", raw, "--out", tmp_path / "cli"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith(f"assay: error: {raw}: a dataset made by stage 'ingest', not 'static'")
    assert not (tmp_path / "cli").exists()


def test_a_file_given_where_an_input_folder_is_expected_is_refused_naming_its_option(tmp_path):
    """`assay report --raw FILE` showed the file as "present" in the page's Inputs table; every input
    folder given a file is now refused before anything is written, naming the path and its option."""
    afile = tmp_path / "raw.parquet"
    afile.write_text("not a dataset folder\n")
    nothing = tmp_path / "nothing"
    base = dict(raw=nothing, static=nothing, domain=nothing, dedup=nothing, curated=nothing, round0=nothing,
                round1=nothing, models=nothing, labelled=nothing / "labelled.json", repo=tmp_path)
    for option in ("raw", "curated", "round0", "round1", "models"):
        with pytest.raises(AssayError, match=re.escape(f"{afile}: is a file, not a directory; --{option} takes ")):
            build_report(ReportInputs(**{**base, option: afile}), tmp_path / "reports", examples_per_reason=0)
        assert not (tmp_path / "reports").exists(), option
    proc = subprocess.run([BIN / "assay", "report", "--raw", afile, "--out", tmp_path / "cli"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith(f"assay: error: {afile}: is a file, not a directory; --raw takes the ingest "
                                  "stage's output folder"), proc.stderr
    assert not (tmp_path / "cli").exists() and afile.read_text() == "not a dataset folder\n"


def test_a_tier2_example_shows_the_value_and_threshold_behind_its_reason(tmp_path):
    """The examples' "scores / detail" cell looked for keys starting with the reason's text, which
    tier 2's keys never do (`dynamic:alignment_stratum_low` rests on `alignment_z`): it was empty."""
    from assay.report_html import ReportInputs, _examples_section

    curated = tmp_path / "curated"
    (curated / "decisions").mkdir(parents=True)
    scores = [("alignment", 0.011), ("alignment_threshold", 0.0), ("alignment_z", -4.2),
              ("alignment_z_low_threshold", -3.5), ("grad_norm_z", 0.3), ("loss_z", 1.2)]
    pq.write_table(pa.table({"id": ["d1"], "stage": ["dynamic"], "kept": [False],
                             "reason": ["dynamic:alignment_stratum_low"],
                             "scores": pa.array([scores], DECISION_SCHEMA.field("scores").type),
                             "detail": pa.nulls(1, pa.string())}, schema=DECISION_SCHEMA),
                   curated / "decisions/part-00000.parquet")
    missing = tmp_path / "missing"
    inputs = ReportInputs(missing, missing, missing, missing, curated, missing, missing, missing, missing, tmp_path)
    page = "".join(_examples_section(inputs, tmp_path / "report", 2).parts)
    # The cell holds what the reason rests on, not another filter's scores (the story beside it has all).
    assert "<td>alignment_z=-4.2, alignment_z_low_threshold=-3.5, alignment=0.011</td>" in page, page


def test_why_shows_the_scores_behind_a_tier2_reason_first():
    from assay.lineage import scores_behind

    scores = {"alignment": 0.02, "alignment_threshold": 0.0, "loss": 9.1, "loss_z": 5.0, "loss_z_high_threshold": 3.5,
              "loss_z_low_threshold": -3.5}
    assert scores_behind("dynamic:loss_high", scores) == [("loss_z", 5.0), ("loss_z_high_threshold", 3.5), ("loss", 9.1)]
    assert scores_behind("gopher_quality:word_count", {"gopher_quality:words": 3.0, "c4:lines": 1.0}) == [
        ("gopher_quality:words", 3.0)]
    assert scores_behind(None, scores) == []


@pytest.mark.parametrize("damage", ["garbage", "cut short", "lost part"])
def test_a_damaged_stage_output_is_named_and_the_rest_of_the_page_is_drawn(tmp_path, damage):
    """A damaged decisions shard made `assay report` an internal error, then (2026-12-07) one error for the
    whole page: now each block that needs it says which file is damaged, and the others are drawn."""
    curated = tmp_path / "data/curated"
    (curated / "decisions").mkdir(parents=True)
    shard = curated / "decisions/part-00000.parquet"
    pq.write_table(pa.table({"id": ["d1"], "stage": ["dynamic"], "kept": [False], "reason": ["dynamic:alignment"],
                             "scores": pa.array([[("alignment", -0.1)]], DECISION_SCHEMA.field("scores").type),
                             "detail": pa.nulls(1, pa.string())}, schema=DECISION_SCHEMA), shard)
    if damage == "lost part":  # the manifest lists a second part that is gone: counts from the first would be wrong
        write_manifest(curated, {"stage": "dynamic", "shards": [], "counts": {},
                                 "streams": {"decisions": [shard.name, "part-00001.parquet"]}})
        named = "part-00001.parquet"
    else:
        data = shard.read_bytes()
        shard.write_bytes(b"PAR1" + b"\x00garbage" * 40 + data[-300:] if damage == "garbage" else data[: len(data) // 2])
        named = str(shard)
    # Dedup's output and round 0's scores are whole: drawn beside the damage.
    _dedup_decisions(tmp_path / "data/dedup", [("k1", None, None), ("a", "exact_dup", "k1"), ("k2", None, None)])
    (tmp_path / "runs/round-0/scores").mkdir(parents=True)
    pq.write_table(pa.table({"step": [4, 4], "sample_id": ["d1", "k1"], "loss": [2.5, 3.0]}),
                   tmp_path / "runs/round-0/scores/part-00000.parquet")
    inputs = ReportInputs(*(tmp_path / p for p in ("data/raw", "data/static", "data/domain", "data/dedup", "data/curated",
                                                  "runs/round-0", "runs/round-1", "models", "labelled.json")), repo=tmp_path)
    summary = build_report(inputs, tmp_path / "reports")
    page = (tmp_path / "reports/index.html").read_text()

    damaged = {key for key, section in summary["sections"].items() if section["damaged"]}
    assert damaged == {"flow", "scores", "curves", "examples"}, summary["sections"]
    assert page.count('class="damaged"') == 4 and page.count(named) >= 4
    assert {"cluster-sizes", "flow-bars", "score-loss"} <= set(summary["charts"]), summary["charts"]
    # The damage is not told as absence: no "Missing" box for tier 2's decisions.
    assert "Missing:</b> tier 2&#x27;s decisions" not in page and "Missing:</b> Tier 2" not in page
    # An example from the whole stage (dedup's `a`) is still there, its `why` story told from dedup alone.
    assert (tmp_path / "reports/why/a.txt").is_file() and "--data " + str(curated) not in page

    # A section that reads its input whole (dedup's clusters) says so in its place, and the page is drawn.
    dedup_shard = tmp_path / "data/dedup/decisions/part-00000.parquet"
    dedup_shard.write_bytes(dedup_shard.read_bytes()[:100])
    summary = build_report(inputs, tmp_path / "reports")
    assert summary["sections"]["clusters"]["damaged"] == 1 and "score-loss" in summary["charts"]
    assert str(dedup_shard) in (tmp_path / "reports/index.html").read_text()


def test_the_why_story_prints_what_a_tier2_reason_rests_on_first():
    """`assay why` printed a tier-2 drop's scores by name, the value behind its reason lost among a dozen."""
    from assay import report

    rows = [{"stage": "dynamic", "dataset": "data/curated", "kept": False, "reason": "dynamic:loss_high",
             "detail": None, "scores": {"alignment": 0.02, "alignment_threshold": 0.0, "loss": 9.1, "loss_z": 5.0,
                                        "loss_z_high_threshold": 3.5, "loss_z_low_threshold": -3.5}}]
    with report.console.capture() as captured:
        report.story("d1", rows)
    printed = " ".join(captured.get().split())  # as one line, whatever the console's width
    assert ("scores: loss_z=5, loss_z_high_threshold=3.5, loss=9.1, alignment=0.02, alignment_threshold=0, "
            "loss_z_low_threshold=-3.5") in printed, printed


def test_the_report_never_writes_into_an_input_nor_over_files_that_are_not_an_earlier_reports(tmp_path, prefect_harness):
    """`assay report --out` wrote index.html, summary.json and why/ into any folder: a dataset (its
    DVC hash changed), a run, or over a site's own index.html; `--measure-labelled --labelled FILE`
    wrote over any file, a dataset's manifest.json included; `--labelled DIR` was an internal error.
    Each is now one line before anything is written, and an earlier report is still replaced."""
    from assay.report_html import require_labelled_out
    from flows.report import report_flow

    raw = tmp_path / "data/raw"
    raw.mkdir(parents=True)
    write_manifest(raw, {"format": "assay-dataset/1", "stage": "ingest", "counts": {"input_records": 0, "documents": 0}})
    run = tmp_path / "runs/round-0"
    run.mkdir(parents=True)
    (run / "metrics.json").write_text("{}")
    site = tmp_path / "site"
    site.mkdir()
    (site / "index.html").write_text("<h1>my homepage</h1>")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    nothing = tmp_path / "nothing"
    inputs = ReportInputs(raw=raw, static=nothing, domain=nothing, dedup=nothing, curated=nothing, round0=run,
                          round1=nothing, models=nothing, labelled=nothing / "labelled.json", repo=tmp_path)

    def snapshot():
        return sorted((str(f.relative_to(tmp_path)), f.read_bytes()) for f in tmp_path.rglob("*") if f.is_file())

    before = snapshot()
    for out, said in ((raw, "is the report's input"), (run / "report", "lies inside the report's input"),
                      (tmp_path, "holds the report's input"), (site, "holds index.html, not an earlier Assay report's"),
                      (tmp_path / "dangling", "symbolic link to nothing")):
        with pytest.raises(AssayError, match=said):
            build_report(inputs, out, examples_per_reason=0)
        assert snapshot() == before, out
    # The labelled measurement's file: absent, or an earlier measurement; nothing else is written over.
    for labelled, said in ((raw / "manifest.json", "lies inside the report's input"), (site / "index.html",
                           "holds something other than a labelled-code measurement"), (tmp_path / "data", "is a directory")):
        with pytest.raises(AssayError, match=said):
            require_labelled_out(ReportInputs(**{**inputs.__dict__, "labelled": labelled}))
    with pytest.raises(AssayError, match="is a directory, not the JSON file"):
        build_report(ReportInputs(**{**inputs.__dict__, "labelled": tmp_path / "data"}), tmp_path / "r0", examples_per_reason=0)
    (tmp_path / "earlier.json").write_text('{"format": "assay-labelled-code/1"}')
    require_labelled_out(ReportInputs(**{**inputs.__dict__, "labelled": tmp_path / "earlier.json"}))
    # The flow checks both before its minute-long measurement, which would need a domain model here.
    before = snapshot()
    with pytest.raises(AssayError, match="holds something other than a labelled-code measurement"):
        report_flow(str(tmp_path / "r1"), raw=str(raw), static=str(nothing), domain=str(nothing), dedup=str(nothing),
                    curated=str(nothing), round0=str(run), round1=str(nothing), models=str(nothing),
                    labelled=str(site / "index.html"), repo=str(tmp_path), measure_labelled=True)
    with pytest.raises(AssayError, match="is the report's input"):
        report_flow(str(raw), raw=str(raw), round0=str(run), repo=str(tmp_path), measure_labelled=True)
    assert snapshot() == before
    # An earlier report, and a folder of other files, take the report; the other files stay.
    first = build_report(inputs, tmp_path / "reports", examples_per_reason=0)
    assert first["format"] == "assay-report/1"
    build_report(inputs, tmp_path / "reports", examples_per_reason=0)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "notes.md").write_text("mine")
    build_report(inputs, tmp_path / "docs", examples_per_reason=0)
    assert (tmp_path / "docs" / "notes.md").read_text() == "mine" and (tmp_path / "docs" / "index.html").is_file()


def test_the_graph_sentence_names_its_cluster_kinds():
    from assay.report_html import _cluster_kinds

    assert _cluster_kinds({"exact": 29, "near": 20, "semantic": 1}) == " (29 exact, 20 near-duplicate, 1 semantic)"
    assert _cluster_kinds(None) == ""  # a dedup output from before the counts were kept


def test_the_inputs_table_says_what_made_each_input_and_flags_a_mix_of_installations(tmp_path):
    """assay.installation: a pipeline rerun in part after an upgrade has stages judged by two programs."""
    from assay.domain.perplexity import REPORT  # the names the trainers write, which the report reads
    from assay.installation import installation
    from assay.quality.head import CONFIG
    from assay.report_html import _installation_text
    from assay.schema import DOCUMENT_SCHEMA
    from assay.staging import UnitWriter, commit, prepare

    for name in ("raw", "static"):
        out = tmp_path / "data" / name
        prepare(out, name)
        writer = UnitWriter(out, "u", DOCUMENT_SCHEMA, target_bytes=1 << 20)
        writer.docs.write(pa.table({"id": ["a"], "text": ["words"], "kind": ["text"], "lang": ["en"],
                                    "source": ["t"], "path": ["a"], "meta": ["{}"]}))
        writer.finish(bytes_in=0, seconds=0.0)
        commit(out, ["u"], {"fingerprint": name, "stage": "ingest" if name == "raw" else "static"})
    older = installation()
    older["packages"]["torch"] = "2.12.0"
    manifest = json.loads((tmp_path / "data/static/manifest.json").read_text())
    (tmp_path / "data/static/manifest.json").write_text(json.dumps({**manifest, "installation": older}))
    (tmp_path / "runs/round-0").mkdir(parents=True)
    (tmp_path / "runs/round-0/metrics.json").write_text(json.dumps({"installation": installation()}))
    # The models record theirs beside them: the head in its config.json, the domain model in its report (whose
    # folder also holds a Hugging Face config.json, without one).
    for model in ("quality", "domain"):
        (tmp_path / "models" / model).mkdir(parents=True)
    (tmp_path / "models/quality" / CONFIG).write_text(json.dumps({"dim": 4, "installation": older}))
    (tmp_path / "models/domain/config.json").write_text(json.dumps({"model_type": "gpt2"}))
    (tmp_path / "models/domain" / REPORT).write_text(json.dumps({"installation": installation()}))
    inputs = ReportInputs(*(tmp_path / p for p in ("data/raw", "data/static", "data/domain", "data/dedup", "data/curated",
                                                   "runs/round-0", "runs/round-1", "models", "labelled.json")),
                          repo=tmp_path)
    build_report(inputs, tmp_path / "reports", examples_per_reason=0)
    page = (tmp_path / "reports/index.html").read_text()
    now, then = _installation_text(installation()), _installation_text(older)
    assert f"<td>{now}</td>" in page and f"<td>{then}</td>" in page and "<th>made by</th>" in page
    assert f"<b>Made by 2 installations:</b> raw, round 0, domain model: {now}; static, quality head: {then}. " \
           "To judge every stage with one, " \
           f"rerun those this installation ({now}) did not make" in page
    (tmp_path / "data/static/manifest.json").write_text(json.dumps(manifest))  # one installation: no flag
    (tmp_path / "models/quality" / CONFIG).write_text(json.dumps({"dim": 4, "installation": installation()}))
    build_report(inputs, tmp_path / "reports", examples_per_reason=0)
    assert "installations:" not in (tmp_path / "reports/index.html").read_text()
