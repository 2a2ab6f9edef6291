"""Benchmark: our heuristic chain against datatrove's filters, on real documents.

    .venv/bin/python bench/heuristics.py [--man-pages 150] [--metadata 150] [--stdlib 60]
                                         [--readmes 150] [--descriptions 150] [--agreement]

The sample is real text every machine with Assay has (the demo corpus's
sources): the Python reference topics (`pydoc_data`), `*.dist-info/METADATA`
of installed packages, man pages rendered with `man` (MANWIDTH=80), stdlib
`.py`/`.txt` files, and long English prose that the filters mostly keep
(README and NEWS files under /usr/share/doc, and the long descriptions of
the METADATA files). Both sides run single-threaded in this process
over the same documents:

- ours: `apply_chain(build_heuristics(...), batch)` over one Arrow batch in
  datatrove-compatible mode (`words: datatrove`, the same work as datatrove),
  with a cold word cache (first pass) and a warm one (second pass, a fresh
  batch), and in the default mode (`words: paper`); every filter scores
  every document, dropped or not;
- datatrove: GopherRepetitionFilter -> GopherQualityFilter -> C4QualityFilter
  (filter_no_terminal_punct=False) -> FineWebQualityFilter as a cascade,
  document by document, as a datatrove pipeline runs them (so its word cache
  is shared between filters, and later filters see only survivors).

It prints a markdown table of documents/s, then how many documents of each
source each of our filters drops on its own and the chain drops, with
datatrove's words and with the papers' (the default). With --agreement it
also runs each datatrove filter on its own and prints the per-filter
agreement table (n, agreement, drop rates, per source).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

_OVERSTRIKE = re.compile(".\x08")


def render_man(path: Path) -> str | None:
    env = dict(os.environ, MANWIDTH="80", MAN_KEEP_FORMATTING="", LC_ALL="C.UTF-8")
    try:
        proc = subprocess.run(["man", "-E", "UTF-8", "-P", "cat", "-l", str(path)],
                              capture_output=True, env=env, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    if proc.returncode != 0 or not proc.stdout:
        return None
    return _OVERSTRIKE.sub("", proc.stdout.decode("utf-8", errors="replace"))


#: Long English prose, the kind of text the filters mostly keep: at least this many characters.
MIN_PROSE_CHARS = 1000


def prose_sample(readmes: int, descriptions: int) -> list[tuple[str, str, str]]:
    """(source, name, text) of long prose: "readme" (README and NEWS files under
    /usr/share/doc, decompressed, the first `readmes` by path) and
    "description" (the long descriptions, the body, of the first
    `descriptions` METADATA files), each at least MIN_PROSE_CHARS long."""
    import gzip

    docs = []
    root = Path("/usr/share/doc")
    paths = sorted({p.resolve(): p for pattern in ("*/README*", "*/NEWS*") for p in root.glob(pattern)
                    if p.is_file() and p.suffix not in (".html", ".htm", ".xz", ".bz2")}.values())
    for path in paths:
        if len([d for d in docs if d[0] == "readme"]) >= readmes:
            break
        opener = gzip.open if path.suffix == ".gz" else open
        try:
            with opener(path, "rb") as handle:
                text = handle.read().decode("utf-8", errors="replace")
        except OSError:
            continue
        if len(text) >= MIN_PROSE_CHARS:
            docs.append(("readme", path.relative_to(root).as_posix(), text))
    purelib = Path(sysconfig.get_paths()["purelib"])
    for path in sorted(purelib.glob("*.dist-info/METADATA")):
        if len([d for d in docs if d[0] == "description"]) >= descriptions:
            break
        body = path.read_text("utf-8", errors="replace").replace("\r\n", "\n").partition("\n\n")[2]
        if len(body) >= MIN_PROSE_CHARS:
            docs.append(("description", path.parent.name, body))
    return docs


def demo_sample(man_pages: int = 150, metadata: int = 150, stdlib: int = 60, readmes: int = 150,
                descriptions: int = 150, max_chars: int | None = None) -> list[tuple[str, str, str]]:
    """(source, name, text) for real documents of the demo corpus's sources.

    Sources: "pydoc" (all reference topics), "metadata" (the first `metadata`
    METADATA files, sorted), "man" (the first `man_pages` pages of man1,
    sorted; none without `man`), "stdlib" (the first `stdlib` top-level .py
    files and the first `stdlib` .txt files, sorted), and long prose that
    the filters mostly keep ("readme", "description": `prose_sample`).
    Documents over `max_chars` characters are left out.
    """
    from pydoc_data.topics import topics

    docs = [("pydoc", name, topics[name]) for name in sorted(topics)]
    purelib = Path(sysconfig.get_paths()["purelib"])
    for path in sorted(purelib.glob("*.dist-info/METADATA"))[:metadata]:
        docs.append(("metadata", path.parent.name, path.read_text("utf-8", errors="replace")))
    man_root = Path("/usr/share/man/man1")
    if man_pages and shutil.which("man") is not None and man_root.is_dir():
        pages = sorted(p for p in man_root.iterdir() if p.is_file())[:man_pages]
        with ThreadPoolExecutor(4) as pool:
            for path, text in zip(pages, pool.map(render_man, pages)):
                if text:
                    docs.append(("man", path.name, text))
    std = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(std.glob("*.py"))[:stdlib] + sorted(std.glob("**/*.txt"))[:stdlib]
    for path in files:
        docs.append(("stdlib", path.relative_to(std).as_posix(), path.read_text("utf-8", errors="replace")))
    docs += prose_sample(readmes, descriptions)
    docs = [d for d in docs if d[2]]
    if max_chars is not None:
        docs = [d for d in docs if len(d[2]) <= max_chars]
    return docs


def to_batch(docs):
    import pyarrow as pa

    return pa.record_batch({
        "id": pa.array([f"{source}/{name}" for source, name, _ in docs]),
        "text": pa.array([text for _, _, text in docs], pa.large_string()),
        "kind": pa.array(["text"] * len(docs)),
    })


def datatrove_filters() -> dict:
    """datatrove's four filters with FineWeb's settings, keyed like ours."""
    from datatrove.pipeline.filters import (
        C4QualityFilter,
        FineWebQualityFilter,
        GopherQualityFilter,
        GopherRepetitionFilter,
    )

    return {
        "gopher_repetition": GopherRepetitionFilter(),
        "gopher_quality": GopherQualityFilter(),
        "c4": C4QualityFilter(filter_no_terminal_punct=False),
        "fineweb_quality": FineWebQualityFilter(),
    }


def datatrove_verdicts(texts: list[str]) -> dict[str, list[bool]]:
    """Each of datatrove's filters on its own, on every text (keep = True).

    Document by document, so that the filters that split words share
    datatrove's word cache (C4, which splits lines into sentences, goes last).
    """
    from datatrove.data import Document

    filters = datatrove_filters()
    order = ["gopher_quality", "gopher_repetition", "fineweb_quality", "c4"]
    out: dict[str, list[bool]] = {name: [] for name in order}
    for i, text in enumerate(texts):
        for name in order:
            result = filters[name].filter(Document(text=text, id=str(i)))
            out[name].append(result is True or (isinstance(result, tuple) and bool(result[0])))
    return out


def run_datatrove_chain(docs, filters) -> list[bool]:
    from datatrove.data import Document

    kept = []
    for i, (_, _, text) in enumerate(docs):
        doc = Document(text=text, id=str(i))
        ok = True
        for filt in filters.values():
            result = filt.filter(doc)
            if not (result is True or (isinstance(result, tuple) and result[0])):
                ok = False
                break
        kept.append(ok)
    return kept


SOURCES = ("pydoc", "man", "metadata", "stdlib", "readme", "description")


def agreement_table(docs, ours: dict, theirs: dict) -> list[dict]:
    """Per filter: n, agreement with datatrove, drop rates (ours, theirs), overall and per source."""
    import numpy as np

    sources = np.array([s for s, _, _ in docs])
    rows = []
    for name, result in ours.items():
        ref = np.array(theirs[name])
        row = {"filter": name, "n": len(docs), "agreement": float(np.mean(ref == result.keep)),
               "dropped_ours": float(np.mean(~result.keep)), "dropped_datatrove": float(np.mean(~ref)),
               "differ": int(np.sum(ref != result.keep)), "per_source": {}}
        for s in SOURCES:
            m = sources == s
            if m.any():
                row["per_source"][s] = {"n": int(m.sum()), "agreement": float(np.mean(ref[m] == result.keep[m])),
                                        "dropped_datatrove": float(np.mean(~ref[m]))}
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--man-pages", type=int, default=150)
    parser.add_argument("--metadata", type=int, default=150)
    parser.add_argument("--stdlib", type=int, default=60)
    parser.add_argument("--readmes", type=int, default=150)
    parser.add_argument("--descriptions", type=int, default=150)
    parser.add_argument("--agreement", action="store_true",
                        help="also run each datatrove filter on its own and print per-filter agreement")
    args = parser.parse_args(argv)

    import numpy as np

    import filters.text_units as text_units
    from assay.config import HeuristicsParams, MarkupParams, RecordsParams, ReflowParams
    from filters.heuristics import apply_chain, build_heuristics

    docs = demo_sample(args.man_pages, args.metadata, args.stdlib, args.readmes, args.descriptions)
    n = len(docs)
    chars = sum(len(text) for _, _, text in docs)
    present = [s for s in SOURCES if any(d[0] == s for d in docs)]
    print(f"sample: {n} documents, {chars / 1e6:.1f} M characters "
          f"({', '.join(f'{s}: {sum(d[0] == s for d in docs)}' for s in present)})\n")

    # Speed and agreement are measured in datatrove-compatible mode (spaCy words, no paragraph
    # reflow), where the work is the same as datatrove's; the default (the papers' words) is timed alongside.
    chain = build_heuristics(HeuristicsParams(words="datatrove", reflow=ReflowParams(enabled=False),
                                              markup=MarkupParams(enabled=False), records=RecordsParams(enabled=False)))
    paper_chain = build_heuristics(HeuristicsParams(words="paper"))
    text_units.WORDS.clear()  # cold cache
    t0 = time.perf_counter()
    ours = apply_chain(chain, to_batch(docs))
    ours_cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    apply_chain(chain, to_batch(docs))
    ours_warm = time.perf_counter() - t0
    text_units.WHITESPACE_WORDS.clear()
    t0 = time.perf_counter()
    apply_chain(paper_chain, to_batch(docs))
    ours_paper = time.perf_counter() - t0

    rows = [("ours, datatrove words, cold word cache", ours_cold), ("ours, datatrove words, warm word cache", ours_warm),
            ("ours, paper words (default), cold cache", ours_paper)]
    dt_kept = None
    try:
        dt = datatrove_filters()
    except ImportError:
        print("(datatrove is not installed: no comparison)\n")
    else:
        from datatrove.utils.text import split_into_words

        split_into_words("warm up spaCy")  # loading the pipeline is not filtering
        t0 = time.perf_counter()
        dt_kept = run_datatrove_chain(docs, dt)
        rows.append(("datatrove 0.10 (spaCy)", time.perf_counter() - t0))
    base = rows[-1][1] if dt_kept is not None else None
    print("| chain | seconds | docs/s | speed-up vs datatrove |")
    print("|---|---:|---:|---:|")
    for label, seconds in rows:
        speedup = f"{base / seconds:.1f}x" if base else "-"
        print(f"| {label} | {seconds:.2f} | {n / seconds:,.0f} | {speedup} |")
    if dt_kept is not None:
        agree = np.mean(np.array(dt_kept) == ours.keep)
        print(f"\nchain verdicts (datatrove words) agree with datatrove's on {agree:.1%} of documents")

    batch = to_batch(docs)
    sources = np.array([s for s, _, _ in docs])
    results = {f.name: f.apply(batch) for f in chain}
    if args.agreement and dt_kept is not None:
        theirs = datatrove_verdicts([text for _, _, text in docs])
        table = agreement_table(docs, results, theirs)
        print("\nEach filter alone, ours in datatrove-compatible mode, against datatrove's:\n")
        print("| filter | n | agreement | differ | dropped: ours | dropped: datatrove | "
              + " | ".join(f"{s}: agreement (datatrove drops)" for s in present) + " |")
        print("|---|---:|---:|---:|---:|---:|" + "---:|" * len(present))
        for row in table:
            cells = [f"{row['per_source'][s]['agreement']:.1%} ({row['per_source'][s]['dropped_datatrove']:.0%})"
                     for s in present]
            print(f"| {row['filter']} | {row['n']} | {row['agreement']:.1%} | {row['differ']} | "
                  f"{row['dropped_ours']:.1%} | {row['dropped_datatrove']:.1%} | " + " | ".join(cells) + " |")
    results["chain"] = ours
    paper = {f.name: f.apply(batch) for f in paper_chain}
    paper["chain"] = apply_chain(paper_chain, batch)
    for title, res in (("datatrove words", results), ("paper words (default)", paper)):
        print(f"\n| dropped, {title} (each filter alone) | " + " | ".join(f"{s} (n={np.sum(sources == s)})" for s in present) + " |")
        print("|---|" + "---:|" * len(present))
        for label, result in res.items():
            cells = [f"{np.mean(~result.keep[sources == s]):.0%}" for s in present]
            print(f"| {label} | " + " | ".join(cells) + " |")
    print("\n| top reasons, paper words | " + " | ".join(present) + " |")
    print("|---|" + "---|" * len(present))
    for label, result in paper.items():
        cells = []
        for s in present:
            reasons = [r for r, src in zip(result.reason, sources) if src == s and r]
            top = sorted({r: reasons.count(r) for r in set(reasons)}.items(), key=lambda kv: -kv[1])[:2]
            cells.append(", ".join(f"{r.split(':', 1)[1]} {c}" for r, c in top) or "-")
        print(f"| {label} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
