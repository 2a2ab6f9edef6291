"""Differential test: our heuristic filters against datatrove's, on real documents.

The sample is built from files every machine with Assay has (the demo
corpus's sources, see bench/heuristics.py): the Python reference topics,
installed packages' METADATA, man pages of man1 rendered with `man` (skipped
without it), stdlib .py/.txt files, and long English prose that the filters
mostly keep (README and NEWS files under /usr/share/doc, and the long
descriptions of the METADATA files), so agreement is also tested where
verdicts are close calls. Our filters run in datatrove-compatible mode
(`words: datatrove`; the default follows the papers, see ARCHITECTURE.md).

What is asserted: for each of the four filters, our keep/drop verdict
agrees with datatrove's (with FineWeb's settings: C4 without the
terminal-punctuation rule) on at least 99% of the documents, and on at
least 98% of the long prose alone; each filter is compared on its own, on
the original text, and must drop a real share, and keep a real share, of
the sample. The measured per-filter table is in BENCHMARKS.md
(`bench/heuristics.py --agreement`).

Deliberate differences, none of which changes a verdict on this sample:
- C4: datatrove rewrites the text (drops lines); we never do, and only
  report `c4:lines_removed_frac`. So in datatrove's *pipeline* a later filter
  (FineWeb quality) sees C4-cleaned text while ours sees the original; that
  is why this test compares filters one by one, not the chain.
- Gopher repetition: datatrove compares duplicated n-grams as their words
  joined without spaces ("ab c" equals "a bc"); we compare the words.
- Words come from our re-implementation of spaCy's English tokenizer
  (test_words_agree_with_spacy measures it), not from spaCy itself.
"""

from __future__ import annotations

import importlib.util
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("datatrove")
pytest.importorskip("spacy")

from assay.config import HeuristicsParams, MarkupParams, RecordsParams, ReflowParams  # noqa: E402
from filters.heuristics import build_heuristics  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("assay_bench_heuristics", ROOT / "bench" / "heuristics.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)  # the sample builder and datatrove's side live in bench/heuristics.py

FILTERS = ["gopher_quality", "gopher_repetition", "c4", "fineweb_quality"]


@pytest.fixture(scope="module")
def sample():
    docs = bench.demo_sample(man_pages=100, metadata=120, stdlib=30, readmes=100, descriptions=80, max_chars=60_000)
    sources = Counter(source for source, _, _ in docs)
    assert sources["pydoc"] >= 50 and sources["metadata"] >= 20 and sources["stdlib"] >= 20, sources
    assert sources["readme"] + sources["description"] >= 100, sources
    return docs


@pytest.fixture(scope="module")
def ours(sample):
    batch = bench.to_batch(sample)
    # datatrove's words; no reflow of wrapped paragraphs, no markup step, no records rule (ours, not datatrove's).
    published = HeuristicsParams(words="datatrove", reflow=ReflowParams(enabled=False),
                                 markup=MarkupParams(enabled=False), records=RecordsParams(enabled=False))
    return {f.name: f.apply(batch) for f in build_heuristics(published)}


@pytest.fixture(scope="module")
def theirs(sample):
    # About 20 s of CPU: the whole module stays well under a minute.
    return {name: np.array(v) for name, v in bench.datatrove_verdicts([t for _, _, t in sample]).items()}


@pytest.mark.parametrize("name", FILTERS)
def test_verdicts_agree_with_datatrove(name, sample, ours, theirs):
    mine = ours[name]
    differ = np.flatnonzero(mine.keep != theirs[name])
    agreement = 1 - len(differ) / len(sample)
    details = [(sample[i][0], sample[i][1], "ours: " + str(mine.reason[i]), "datatrove keeps: " + str(theirs[name][i]))
               for i in differ[:10]]
    assert agreement >= 0.99, (name, agreement, details)
    prose = np.array([source in ("readme", "description") for source, _, _ in sample])
    assert np.mean(mine.keep[prose] == theirs[name][prose]) >= 0.98, name
    # Both sides drop, and keep, a real share of these documents, so agreement is not trivial.
    assert 0.05 < np.mean(~theirs[name]) < 0.95, np.mean(~theirs[name])


def test_words_agree_with_spacy(sample):
    """Our word splitting gives spaCy's tokens for (nearly) every chunk of the sample."""
    import pyarrow as pa
    import spacy
    from spacy.attrs import IDX

    from filters.text_units import WordSplitter

    chunks = Counter(chunk for _, _, text in sample for chunk in text.split())
    unique = list(chunks)
    starts = np.cumsum([0] + [len(c) + 1 for c in unique[:-1]])
    # spaCy splits each space-separated chunk on its own: one call for all of them.
    doc = spacy.blank("en").tokenizer(" ".join(unique))
    theirs = doc.to_array([IDX]).astype(np.int64)
    # Ours, as token start offsets in the same joined text.
    tokens = WordSplitter().split(pa.array(unique))
    within = np.arange(len(tokens.ids)) - tokens.offsets[:-1][tokens.row]
    first_in_chunk = within == 0
    lengths = tokens.length.astype(np.int64)
    before = np.cumsum(lengths) - lengths  # characters of earlier tokens, reset per chunk below
    ours = starts[tokens.row] + before - np.repeat(before[first_in_chunk], tokens.counts[tokens.counts > 0])
    differ = np.setxor1d(ours, theirs)
    wrong_chunks = np.unique(np.searchsorted(starts, differ, side="right") - 1)
    wrong = Counter({unique[i]: chunks[unique[i]] for i in wrong_chunks.tolist()})
    share = sum(wrong.values()) / sum(chunks.values())
    assert share <= 0.001, wrong.most_common(10)
