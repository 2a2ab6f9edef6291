"""The CLI through its installed entry point (`assay`), as a user runs it."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from assay.schema import document_id

pytestmark = pytest.mark.usefixtures("cli_on_session_api")  # conftest: no temporary server per command

ASSAY = shutil.which("assay", path=str(Path(sys.executable).parent)) or "assay"


def run(*args, cwd=None, check=True, env=None):
    proc = subprocess.run([ASSAY, *map(str, args)], capture_output=True, text=True, cwd=cwd, timeout=300, env=env)
    if check and proc.returncode != 0:
        raise AssertionError(f"assay {' '.join(map(str, args))} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return proc


def test_help_explains_every_command():
    out = run("--help").stdout
    for command in ("ingest", "stats", "show", "why"):
        assert command in out
    ingest_help = run("ingest", "--help").stdout
    assert "--text-field" in ingest_help and "hf:PATH" in ingest_help and "quarantined" in ingest_help


@pytest.fixture(scope="module")
def ingested(tmp_path_factory):
    from corpus import make_bad_corpus

    root = tmp_path_factory.mktemp("cli")
    corpus = make_bad_corpus(root)
    out = root / "raw"
    proc = run("ingest", corpus["tree"], corpus["jsonl"], "--out", out)
    return {"out": out, "stdout": proc.stdout, "root": root, "corpus": corpus}


def test_ingest_prints_the_summary(ingested):
    stdout = ingested["stdout"]
    for line in ("documents kept", "quarantined", "invalid:json", "invalid:too_large", "invalid:binary"):
        assert line in stdout


def test_stats_json(ingested):
    stats = json.loads(run("stats", ingested["out"], "--json").stdout)
    assert stats["documents"] == 7 and stats["quarantined"] == 8
    by_kind = {row["kind"]: row["documents"] for row in stats["by_kind"]}
    assert by_kind == {"code": 3, "text": 4}
    assert stats["tokens"] == round(stats["bytes"] / 4)
    made_by = json.loads((Path(ingested["out"]) / "manifest.json").read_text())["installation"]
    assert stats["made_by"] == made_by and made_by["packages"]["torch"]
    shown = run("stats", ingested["out"]).stdout
    assert "by source" in shown
    assert f"made by Assay {made_by['assay']} (code {made_by['code']}), Python {made_by['python']}, " \
           f"torch {made_by['packages']['torch']}, transformers {made_by['packages']['transformers']}" in shown


def test_show_and_why_answer(ingested):
    out = ingested["out"]
    doc = json.loads(run("show", document_id("corpus", "src/app.py"), "--data", out, "--json").stdout)
    assert doc["text"].startswith("def add") and doc["lang"] == "python"
    story = json.loads(run("why", "r1", "--data", out, "--json").stdout)
    assert story[0]["kept"] is True and story[0]["stage"] == "ingest"
    bad = document_id("records.jsonl", "line:4")
    text = run("why", bad, "--data", out).stdout
    assert "invalid:json" in text and "dropped" in text


def test_errors_are_one_line_without_traceback(ingested, tmp_path):
    # train and score: said before Prefect's temporary server starts (its log lines were on stderr too), so
    # these commands run as a user's do without a server: not on the session's API (cli_on_session_api).
    import os

    alone = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    for args in (["ingest", tmp_path / "missing", "--out", tmp_path / "o"],
                 ["stats", tmp_path / "missing"],
                 ["show", "nope", "--data", ingested["out"]],
                 ["train", "--data", tmp_path / "missing", "--out", tmp_path / "run"],
                 ["score", "--run", tmp_path / "run", "--data", tmp_path / "missing", "--out", tmp_path / "s"]):
        proc = run(*args, check=False, env=alone)
        assert proc.returncode == 1
        assert proc.stderr.strip().startswith("assay: error:"), proc.stderr
        assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    debug = run("--debug", "stats", tmp_path / "missing", check=False)
    assert "Traceback" in debug.stderr


def test_bad_params_file_is_a_clear_error(tmp_path):
    (tmp_path / "params.yaml").write_text("ingest:\n  max_bytez: 1\n")
    proc = run("ingest", tmp_path, "--out", tmp_path / "o", cwd=tmp_path, check=False)
    assert proc.returncode == 1 and "unknown key ingest.max_bytez" in proc.stderr


# --- read side, from a probe (2026-12-06) ------------------------------------------------------------------------


def _one_line_error(proc, *fragments):
    assert proc.returncode == 1, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("assay: error:") and "Traceback" not in proc.stderr, proc.stderr
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


def test_stats_and_show_refuse_a_folder_of_other_parquet(ingested, tmp_path):
    """`stats` on a stage's decisions/ or embeddings/ was an internal KeyError ('Field "text" does not
    exist'), and `show` printed a decision row as the document (rc 0)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from assay.schema import embedding_schema

    out = ingested["out"]
    embeddings = tmp_path / "static" / "embeddings"
    embeddings.mkdir(parents=True)
    pq.write_table(pa.table({"id": ["a", "b"], "vector": [[1.0, 0.0], [0.0, 1.0]]}, schema=embedding_schema(2)),
                   embeddings / "part-00000.parquet")
    doc = document_id("corpus", "src/app.py")
    for folder, doc_id, columns in ((out / "decisions", doc, "id, stage, kept"), (embeddings, "a", "id, vector")):
        for args in (["stats", folder], ["show", doc_id, "--data", folder]):
            proc = run(*args, check=False)
            _one_line_error(proc, f"{folder}: not a document dataset", "no 'text' column", f"(it has: {columns}",
                            "no manifest.json", f"give the dataset that holds it, {folder.parent}")
            assert proc.stdout == ""  # nothing printed as a document
    # The dataset itself still reads.
    assert json.loads(run("stats", out, "--json").stdout)["documents"] == 7


def _corrupt_pages(shard: Path) -> None:
    """Garbage over every byte between the magic number and the footer: the footer still reads."""
    data = bytearray(shard.read_bytes())
    footer = int.from_bytes(data[-8:-4], "little")
    data[4:len(data) - 8 - footer] = b"\xab" * (len(data) - 12 - footer)
    shard.write_bytes(bytes(data))


def _corrupt_footer(shard: Path) -> None:
    """Garbage over the footer's metadata, its length and magic number kept: thrift's message ends in a newline."""
    data = bytearray(shard.read_bytes())
    footer = int.from_bytes(data[-8:-4], "little")
    data[len(data) - 8 - footer:len(data) - 8] = b"\xab" * footer
    shard.write_bytes(bytes(data))


def test_why_on_a_corrupt_decisions_shard_names_it_in_one_line(ingested, tmp_path):
    """A decisions part cut short, or with garbage pages under a sound footer, was pyarrow's ArrowInvalid
    (an internal error; with --debug a traceback) and thrift's message ended in a newline."""
    import pyarrow.parquet as pq

    for name, damage in (("cut", lambda p: p.write_bytes(p.read_bytes()[:300])), ("pages", _corrupt_pages),
                         ("footer", _corrupt_footer)):
        data = shutil.copytree(ingested["out"], tmp_path / name)
        # The shard that holds r1's decision: a row group whose id range leaves r1 out is never read.
        shard = next(s for s in sorted((data / "decisions").glob("part-*.parquet"))
                     if "r1" in pq.read_table(s, columns=["id"]).column("id").to_pylist())
        damage(shard)
        _one_line_error(run("why", "r1", "--data", data, check=False), str(shard))


def test_why_lists_a_dataset_given_twice_once(ingested, tmp_path):
    out = ingested["out"]
    (tmp_path / "link").symlink_to(out)
    once = json.loads(run("why", "r1", "--data", out, "--json").stdout)
    assert len(once) == 1
    twice = json.loads(run("why", "r1", "--data", out, "--data", f"{out}/", "--data", tmp_path / "link",
                           "--data", out / ".." / out.name, "--json").stdout)
    assert twice == once
    text = run("why", "r1", "--data", out, "--data", out).stdout
    assert "(1 decision(s)" in text and text.count("• ingest") == 1


LONG_A = "corpus/" + "deeply/nested/" * 8 + "alpha.txt#line:000123"
LONG_B = "corpus/" + "deeply/nested/" * 8 + "beta.txt#line:000456"


def _column(text: str, header: str) -> str:
    """A rich table's column read top to bottom, its cells' pieces joined: what a reader gets back of
    its values, folded or not (a cut one ends in '…')."""
    def read(mark: str, index: int) -> str:
        return "".join(line.strip(mark).split(mark)[index].strip()
                       for line in text.splitlines() if line.startswith(mark))

    columns = text.splitlines()[[line.startswith("┃") for line in text.splitlines()].index(True)].count("┃") - 1
    return read("│", [read("┃", i) for i in range(columns)].index(header))


def test_similar_and_cluster_print_ids_whole_at_80_columns(tmp_path):
    """At 80 columns rich cut ids to 'corpus/deeply/nested/d…'; no command could take them back."""
    import os

    import numpy as np

    from assay.config import load_params
    from assay.vectors import ClusterRecord, DocumentRecord, open_store
    from corpus import write_documents

    data = write_documents(tmp_path / "dedup", [("a", "alpha text"), ("b", "beta text")])
    with open_store(load_params(None).vectors, data) as store:
        store.upsert_documents([
            DocumentRecord(LONG_A, np.array([1, 0, 0, 0.1], np.float32), source="corpus", status="kept",
                           path="x/a.txt", clusters=["c1"]),
            DocumentRecord(LONG_B, np.array([1, 0, 0.1, 0], np.float32), source="corpus", status="near_dup",
                           path="x/b.txt", clusters=["c1"], duplicate_of=LONG_A)])
        store.upsert_clusters([ClusterRecord("c1", "near", [LONG_A, LONG_B])])
    env = {**os.environ, "COLUMNS": "80"}
    for args in (["similar", LONG_A, "-k", "1"], ["cluster", LONG_A]):
        proc = subprocess.run([ASSAY, *args, "--data", str(data)], capture_output=True, text=True, env=env, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        # Not a terminal: each id on one line, whole, for grep and `assay why`.
        assert "…" not in proc.stdout and LONG_B in proc.stdout, proc.stdout
    assert _column(proc.stdout, "duplicate_of") == LONG_A and _column(proc.stdout, "doc_id") == LONG_A + LONG_B


def test_tables_fold_ids_commits_and_counts_on_a_narrow_terminal(monkeypatch):
    """On an 80-column terminal an id, a commit or a count is folded inside its cell, never cut with '…'."""
    import io

    from rich.console import Console

    from assay import report
    from assay.history import Version
    from assay.vectors import Hit

    def render(draw) -> str:
        buffer = io.StringIO()
        monkeypatch.setattr(report, "console", Console(file=buffer, force_terminal=True, width=80, color_system=None))
        draw()
        return buffer.getvalue()

    hits = render(lambda: report.hits([Hit(LONG_A, 0.99, "corpus", "kept", {"path": "x/a.txt"})], False, True))
    assert _column(hits, "doc_id") == LONG_A and max(map(len, hits.splitlines())) <= 80
    members = [{"doc_id": LONG_A, "status": "kept"}, {"doc_id": LONG_B, "status": "near_dup", "duplicate_of": LONG_A}]
    clusters = render(lambda: report.clusters(LONG_A, {"c1": members}, False))
    assert _column(clusters, "doc_id") == LONG_A + LONG_B and _column(clusters, "duplicate_of") == LONG_A

    commit = "a84f1d7e" + "0" * 32
    outputs = [{"path": f"data/{p}", "md5": f"{i:032x}.dir", "documents": 1_234_567}
               for i, p in enumerate(("raw", "static", "domain", "dedup", "curated"))]
    version = Version(commit, "2026-12-06T19:42:00", "Read side, from a probe: export never deletes the run",
                      ["v1", "release-2026-12"], ["data/raw"], outputs)
    table = render(lambda: report.versions([version], "."))
    assert _column(table, "commit") == commit[:8] and _column(table, "tags") == "v1,release-2026-12"
    assert _column(table, "raw") == "1,234,567" and max(map(len, table.splitlines())) <= 80


def test_versions_table_off_a_terminal_keeps_every_cell_on_one_line(monkeypatch, capsys):
    from assay import report
    from assay.history import Version

    monkeypatch.setenv("COLUMNS", "80")
    commit = "a84f1d7e" + "0" * 32
    outputs = [{"path": f"data/{p}", "md5": f"{i:032x}.dir", "documents": 1_234_567}
               for i, p in enumerate(("raw", "static", "domain", "dedup", "curated"))]
    report.versions([Version(commit, "2026-12-06T19:42:00", "data v2", ["v1", "release-2026-12"], ["data/raw"],
                             outputs)], ".")
    row = next(line for line in capsys.readouterr().out.splitlines() if commit[:8] in line)
    assert "…" not in row and row.count("1,234,567") == 5 and "v1, release-2026-12" in row


def test_both_version_tables_draw_one_grid_where_a_stage_never_run_holds_no_data(monkeypatch, capsys):
    """`assay versions` printed "?" documents for an output whose stage was declared but never run at
    that commit (no hash), where the report's lineage table drew it as empty: two walks over the same
    versions. Both now draw `history.version_grid`: no data there, an empty cell; an unreadable count, "?"."""
    from assay import report
    from assay.history import Version, version_grid

    monkeypatch.setenv("COLUMNS", "200")
    older = Version("1" * 40, "2026-12-05T10:00:00", "ingest only", [], ["data/raw"],
                    [{"path": "data/raw", "md5": "a" * 32 + ".dir", "documents": 10},
                     {"path": "data/static", "md5": None, "documents": None}])
    newer = Version("2" * 40, "2026-12-06T10:00:00", "static too", [], ["data/static"],
                    [{"path": "data/raw", "md5": "a" * 32 + ".dir", "documents": 10},
                     {"path": "data/static", "md5": "b" * 32 + ".dir", "documents": None, "error": "no manifest"},
                     {"path": "data/never", "md5": None, "documents": None}])
    paths, grid, errors = version_grid([newer, older])
    assert paths == ["data/raw", "data/static"]  # data/never holds data in no version: no column
    assert [[o and o["documents"] for o in row] for row in grid] == [[10, None], [10, None]]
    assert grid[1][1] is None and grid[0][1]["error"] == "no manifest" and errors == ["no manifest"]
    report.versions([newer, older], ".")
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if "commit" in line).split("┃")
    assert [c.strip() for c in header[5:-1]] == ["raw", "static"], out
    static = {line.split()[1]: line.split("│")[6].strip() for line in out.splitlines() if line.startswith(("│ 1", "│ 2"))}
    assert static == {"22222222": "?", "11111111": ""}, out
    assert "?: no manifest" in out


def test_a_users_error_inside_a_flow_is_one_line_without_prefects_error_log(ingested, tmp_path):
    """A stage's AssayError raised inside the Prefect flow (here: no quality head) came after Prefect's
    own `ERROR | Flow run ... Encountered exception` line and its `Finished in state Failed(...)` line,
    the same message three times; the console keeps only the CLI's line (the API still gets the log)."""
    (tmp_path / "params.yaml").write_text(f"static:\n  head: {tmp_path / 'no-head'}\n")
    proc = run("--params", tmp_path / "params.yaml", "run", "static", "--in", ingested["out"], "--out", tmp_path / "s",
               check=False)
    assert proc.returncode == 1, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    said = [line for line in lines if "no trained quality head" in line]
    assert len(said) == 1 and said[0].startswith("assay: error:"), lines
    assert not [line for line in lines if "ERROR" in line or "Traceback" in line], lines


#: An id, a path and a text that are console markup (a closing tag with nothing to close, a style, an
#: emoji code) and end in a backslash, which `rich.markup.escape` would double.
MARKUP_ID = "x[/]y[bold]z:smile:\\"
MARKUP_TEXT = "Some [red]words[/] and :smile: in a [bold]text[/], ending in a backslash \\"


def _wide(*args) -> list[str]:
    """`assay ARGS`'s output lines, at 1,000 columns: off a terminal rich wraps at 80."""
    import os

    proc = subprocess.run([ASSAY, *map(str, args)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "COLUMNS": "1000"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.splitlines()


def test_show_and_why_print_ids_texts_and_details_that_look_like_markup_literally(tmp_path):
    """`assay show` of an id holding `[/]` was an internal error (rich's MarkupError, rc 2); `why` printed
    `x[/]y[bold]z` as `xyz`, in bold; `:smile:` in a text became an emoji. They are the user's data."""
    source = tmp_path / "h[bold]ostile.jsonl"
    source.write_text(json.dumps({"id": MARKUP_ID, "text": MARKUP_TEXT, "path": "p[bold]q[/]"}) + "\n"
                      + json.dumps({"id": MARKUP_ID, "text": "a later record under that id"}) + "\n")
    out = tmp_path / "raw[bold]"
    run("ingest", source, "--out", out)

    shown = _wide("show", MARKUP_ID, "--data", out)
    assert f"id: {MARKUP_ID}" in shown and "path: p[bold]q[/]" in shown and "source: h[bold]ostile.jsonl" in shown
    assert MARKUP_TEXT in shown, shown

    story = _wide("why", MARKUP_ID, "--data", out)
    assert story[0] == f"why {MARKUP_ID} (2 decision(s), oldest first)", story
    assert story[1] == f"• ingest ({out}): kept", story
    assert story[2] == f"• ingest ({out}): dropped invalid:duplicate_id", story
    assert story[3] == f"    detail: line 2: id {MARKUP_ID!r} is an earlier record's in this file, which keeps it", story

    missing = run("why", "no[/]such[bold]id", "--data", out, check=False)
    assert missing.returncode == 1 and missing.stdout == "no decisions about no[/]such[bold]id in the given datasets\n"


def test_graph_prints_ids_that_look_like_markup_literally(tmp_path):
    """`assay graph` printed ids, paths and cluster ids through console markup: `[/]` was rc 2."""
    import numpy as np

    from assay.config import load_params
    from assay.vectors import ClusterRecord, DocumentRecord, open_store
    from corpus import write_documents

    other, cluster = "w[/]v[bold]", "c[/]1[red]"
    data = write_documents(tmp_path / "dedup", [("a", "alpha text"), ("b", "beta text")])
    with open_store(load_params(None).vectors, data) as store:
        store.upsert_documents([
            DocumentRecord(MARKUP_ID, np.array([1, 0, 0, 0.1], np.float32), source="s[bold]", status="kept",
                           path="p[/]:smile:", clusters=[cluster]),
            DocumentRecord(other, np.array([1, 0, 0.1, 0], np.float32), source="s[bold]", status="near_dup",
                           path="q[bold]", clusters=[cluster], duplicate_of=MARKUP_ID)])
        store.upsert_clusters([ClusterRecord(cluster, "near", [MARKUP_ID, other])])
    node = _wide("graph", MARKUP_ID, "--data", data)
    assert node == [f"{MARKUP_ID}  status: kept  source: s[bold]  path: p[/]:smile:",
                    f"  in cluster: {cluster} (near, 2 members)",
                    f"  duplicated by: {other}"], node
    node = _wide("graph", other, "--data", data)
    assert node[:2] == [f"{other}  status: near_dup  source: s[bold]  path: q[bold]", f"  duplicate of: {MARKUP_ID}"], node


def test_ingest_and_stats_print_kinds_languages_and_sources_that_look_like_markup_literally(tmp_path):
    """A JSONL `"kind": "[/]"` ended `assay ingest` in rc 2 after the dataset was written (the summary's
    `kind=[/]` row was a MarkupError), and `assay stats` failed on that dataset the same way."""
    source = tmp_path / "s[bold]rc.jsonl"
    source.write_text(json.dumps({"id": "a", "text": "Some text here.", "kind": "[/]", "lang": "[bold]x"}) + "\n")
    out = tmp_path / "raw"
    summary = _wide("ingest", source, "--out", out)
    assert any("kind=[/]" in line for line in summary), summary
    stats = _wide("stats", out)
    assert any(line.startswith(f"{out}: 1 documents") for line in stats), stats
    assert any("[bold]x" in line for line in stats) and any("s[bold]rc.jsonl" in line for line in stats), stats


def test_show_and_why_keep_each_line_whole_off_a_terminal(tmp_path):
    """Off a terminal rich wrapped `show` and `why` at 80 columns: a long id or path broke across two
    lines, which defeats grep and pasting it into `assay why`; a document's own lines were re-wrapped."""
    import os

    long_id = "corpus/" + "deeply-nested/" * 10 + "file.py"
    text = "A line of the document that runs on well past eighty columns, " * 3 + "and ends here."
    source = tmp_path / "long.jsonl"
    source.write_text(json.dumps({"id": long_id, "text": text, "path": long_id}) + "\n")
    run("ingest", source, "--out", tmp_path / "raw")
    env = {**os.environ, "COLUMNS": "80"}
    for args in (["why", long_id], ["show", long_id]):
        proc = subprocess.run([ASSAY, *args, "--data", str(tmp_path / "raw")], capture_output=True, text=True,
                              env=env, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        lines = proc.stdout.splitlines()
        assert any(long_id in line for line in lines), lines
        if args[0] == "show":
            assert text in lines, lines  # the document's own line, not re-wrapped


def test_why_refuses_a_decisions_scores_or_run_folder_as_show_does(ingested, tmp_path):
    """`why ID --data data/raw/decisions` (or a run's scores/) said "no decisions about ID in the given
    datasets" (rc 1), as if the dataset had judged no such document; `show` names what the folder is."""
    import pyarrow.parquet as pq

    from assay.schema import SCORE_SCHEMA

    out = ingested["out"]
    scores = tmp_path / "run" / "scores"
    scores.mkdir(parents=True)
    pq.write_table(SCORE_SCHEMA.empty_table(), scores / "part-00000.parquet")
    (scores / "manifest.json").write_text(json.dumps({"format": "assay-scores/1", "shards": ["part-00000.parquet"]}))
    (tmp_path / "run" / "metrics.json").write_text("{}\n")
    for folder, says in ((out / "decisions", f"give the dataset that holds it, {out}"),
                         (scores, "no 'id' or 'text' column (it has: step, sample_id"),
                         (tmp_path / "run", "not an Assay dataset")):
        for command in ("show", "why"):
            line = _one_line_error(run(command, "r1", "--data", folder, check=False), f"{folder}: ", says)
            assert "no decisions about" not in line
        # Also when it comes after a dataset that holds the document's decisions.
        _one_line_error(run("why", "r1", "--data", out, "--data", folder, check=False), f"{folder}: ", says)

    # What why reads still reads: a stage's output that kept nothing (no shard) tells its drops.
    empty = shutil.copytree(out, tmp_path / "kept-nothing")
    for shard in empty.glob("part-*.parquet"):
        shard.unlink()
    manifest = json.loads((empty / "manifest.json").read_text())
    (empty / "manifest.json").write_text(json.dumps({**manifest, "shards": []}))
    bad = document_id("records.jsonl", "line:4")
    story = json.loads(run("why", bad, "--data", empty, "--data", out, "--json").stdout)
    assert [row["reason"] for row in story] == ["invalid:json", "invalid:json"]


def test_a_dataset_whose_parts_differ_from_its_manifest_is_refused_naming_the_part(ingested, tmp_path):
    """Found by a probe (2026-12-07): a copied part-*.parquet was counted (391 ids twice in `stats`),
    and a lost decisions/ or quarantine/ part made `why` and `show` answer "no decisions" / "not in"."""
    out = ingested["out"]
    manifest = json.loads((out / "manifest.json").read_text())
    for stream in ("decisions", "quarantine"):
        assert manifest["streams"][stream] == sorted(p.name for p in (out / stream).glob("part-*.parquet"))

    extra = shutil.copytree(out, tmp_path / "extra")
    shutil.copy(extra / "part-00000.parquet", extra / "part-00009.parquet")
    proc = run("stats", extra, check=False)
    assert proc.returncode == 1 and (
        f"{extra}: part-00009.parquet is not among the {len(manifest['shards'])} shards its manifest.json lists, "
        "so not part of this dataset; move it away" in proc.stderr), proc.stderr

    lost = shutil.copytree(out, tmp_path / "lost")
    (lost / "decisions" / "part-00000.parquet").unlink()
    proc = run("why", "r1", "--data", lost, check=False)
    assert proc.returncode == 1 and f"{lost / 'decisions'}: 1 of the {len(manifest['streams']['decisions'])} " \
        "decisions/ shards its manifest.json lists are missing (part-00000.parquet)" in proc.stderr, proc.stderr

    shutil.rmtree(lost / "quarantine")
    proc = run("show", document_id("records.jsonl", "line:4"), "--data", lost, check=False)
    assert proc.returncode == 1 and "quarantine/ shards its manifest.json lists are missing" in proc.stderr, proc.stderr


@pytest.mark.parametrize("text, why", [("[]", "an array, not a JSON object"), ("null", "null, not a JSON object"),
                                       ('{"shards": "part-00000.parquet"}', "shards should be a list of file names"),
                                       ('{"counts": ["lots"]}', "counts should be an object"),
                                       ('{"streams": {"decisions": "part-00000.parquet"}}',
                                        "streams should map a folder to a list of file names")])
def test_a_manifest_of_the_wrong_shape_is_a_corrupt_manifest(ingested, tmp_path, text, why):
    """Valid JSON of another shape was an internal error (AttributeError: 'list' object has no attribute 'get')."""
    copy = shutil.copytree(ingested["out"], tmp_path / "copy")
    (copy / "manifest.json").write_text(text)
    for args in (["stats", copy], ["show", "r1", "--data", copy], ["why", "r1", "--data", copy]):
        proc = run(*args, check=False)
        assert proc.returncode == 1, proc.stderr
        assert proc.stderr.strip() == f"assay: error: {copy / 'manifest.json'}: corrupt manifest ({why})", proc.stderr


def test_show_counts_an_empty_files_bytes_and_errors_escape_control_characters(ingested):
    """Found by a probe (2026-12-07): an empty file's record showed `raw_bytes: None`, and an id
    holding an escape sequence was printed raw into the error line, restyling the terminal."""
    out = ingested["out"]
    record = json.loads(run("show", document_id("corpus", "empty.txt"), "--data", out, "--json").stdout)
    assert record["status"] == "quarantined" and record["raw_bytes"] == 0
    proc = run("show", "a\x1b[31mRED\x07", "--data", out, check=False)
    assert proc.returncode == 1 and "\x1b" not in proc.stderr and "\x07" not in proc.stderr
    assert proc.stderr.startswith("assay: error: a\\x1b[31mRED\\x07: not in"), proc.stderr
