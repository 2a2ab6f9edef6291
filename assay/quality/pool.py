"""The labelled pool: how tier 1's verdicts are measured on the demo corpus.

GPT-3's recipe trains a quality classifier on a reference set and filters a
different, unfiltered pool. The demo corpus has both (`assay.ingest.demo`):
the reference set (Python reference topics, man pages) and a pool of text
files from software installed on the machine. Tier 1 is measured on the pool.

**Labels come from provenance only** (the kind of file a document was read
from), written down here before any score of tier 1 was computed on the pool:

- good prose: the long description of a wheel (`pypi-description`, the body
  of METADATA), README files (`doc-readme`) and NEWS files (`doc-news`) of
  installed software, when at least `MIN_GOOD_CHARS` long ("long English
  prose": a three-line README.Debian stub is too short to call either way,
  and is left unlabelled);
- junk, at any length: METADATA header blocks (`pypi-metadata`), install
  manifests (`pypi-record`, `dpkg-manifest`), entry-point tables
  (`pypi-entry-points`), Debian changelogs (`debian-changelog`: a log of
  packaging events in a fixed, machine-parsed format), and logs (`logs`);
- junk, the optional kinds added by tier1f (`assay.ingest.demo.EXTRA_POOL_KINDS`,
  in the demo when `demo.system_files` > 0, so that the head's negatives cover
  more shapes of machine data than records and logs), at any length: CA certificates (`sys-ca-cert`, PEM), source-highlight's
  language definitions (`sys-source-highlight`), fontconfig's configuration
  (`sys-fontconfig`, XML), udev rules (`sys-udev-rules`), systemd's
  tmpfiles/sysusers/sysctl/modprobe/binfmt fragments (`sys-conf-fragment`),
  autoconf macros (`sys-m4`) and Tcl's message catalogues (`sys-tcl-msgs`):
  files read by programs, none written to be read as prose. (Labelled
  before any score of them was computed; fresh set 5, `assay.quality.fresh5`,
  was drawn from other folders before they were added.)
- unlabelled (in the pool, filtered, not counted): upstream changelogs
  (`doc-changelog`, anything from narrative release notes to GNU ChangeLog
  entries) and copyright files (`doc-copyright`, DEP-5 fields around
  licence texts); neither is clearly one or the other by provenance.

**Split.** A hash of the document id (and `quality.seed`) cuts the pool in
three: the head's negatives may only come from the first part
(`quality.negatives_share`); the next part (`quality.dev_share`) is for
choosing settings (the words head's L2 penalty, the per-source rule choice,
`static.threshold`) and for the head's Platt scaling; tier 1 is measured on
the rest, so no document the head was trained or calibrated on, or that a
setting was chosen on, is counted. `assay.quality.fresh`,
`assay.quality.fresh2`, `assay.quality.fresh3`, `assay.quality.fresh4` and
`assay.quality.fresh5` are five more labelled sets of other files, for
reporting only.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from assay.config import Params
from assay.encoder import Encoder
from assay.ingest.demo import EXTRA_POOL_KINDS
from assay.quality.metrics import calibration_table, expected_calibration_error, roc_auc
from assay.quality.scorer import Scorer
from assay.schema import KIND_TEXT
from assay.shards import iter_batches, require_dataset
from filters.heuristics import apply_by_source, apply_chain, build_heuristics

GOOD = 1
JUNK = 0
UNLABELLED = -1

#: Label of each pool source (set by provenance, before any score was seen).
POOL_LABELS: dict[str, int] = {
    "pypi-description": GOOD,
    "doc-readme": GOOD,
    "doc-news": GOOD,
    "pypi-metadata": JUNK,
    "pypi-record": JUNK,
    "pypi-entry-points": JUNK,
    "dpkg-manifest": JUNK,
    "debian-changelog": JUNK,
    "logs": JUNK,
    **{source: JUNK for source in EXTRA_POOL_KINDS},
    "doc-changelog": UNLABELLED,
    "doc-copyright": UNLABELLED,
}
#: Good-provenance documents shorter than this (characters) are left unlabelled.
MIN_GOOD_CHARS = 1000


def pool_labels(sources: Iterable[str], lengths: Iterable[int]) -> np.ndarray:
    """GOOD / JUNK / UNLABELLED per document (sources outside the pool: UNLABELLED)."""
    return labels_by_source(sources, lengths, POOL_LABELS)


def labels_by_source(sources: Iterable[str], lengths: Iterable[int], source_labels: Mapping[str, int]) -> np.ndarray:
    """Each document's label from its source, good ones shorter than MIN_GOOD_CHARS left unlabelled."""
    out = []
    for source, length in zip(sources, lengths):
        label = source_labels.get(source, UNLABELLED)
        if label == GOOD and length < MIN_GOOD_CHARS:
            label = UNLABELLED
        out.append(label)
    return np.array(out, dtype=np.int8)


NEGATIVES, DEV, MEASURED = "negatives", "dev", "measured"


def _position(ids: Iterable[str], seed: int) -> np.ndarray:
    """Each id's place in [0, 1), by a hash of the seed and the id."""
    return np.array([
        int.from_bytes(hashlib.blake2b(f"{seed}:{i}".encode(), digest_size=8).digest(), "little") / 2**64
        for i in ids
    ], dtype=np.float64)


def in_negatives_part(ids: Iterable[str], share: float, seed: int) -> np.ndarray:
    """True for the documents the head may take negatives from: a `share` of them, by a hash of the id.

    The part depends only on the id and the seed, so it is the same in
    training and in measurement, across runs and datasets.
    """
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"share must be in [0, 1], not {share}")
    return _position(ids, seed) < share


def pool_parts(ids: Iterable[str], negatives_share: float, dev_share: float, seed: int) -> np.ndarray:
    """NEGATIVES, DEV or MEASURED per id (see the module docstring)."""
    if not (0.0 <= negatives_share and 0.0 <= dev_share and negatives_share + dev_share <= 1.0):
        raise ValueError(f"shares must be non-negative and sum to at most 1 ({negatives_share} + {dev_share})")
    position = _position(ids, seed)
    parts = np.full(len(position), MEASURED, dtype=object)
    parts[position < negatives_share + dev_share] = DEV
    parts[position < negatives_share] = NEGATIVES
    return parts


def keep_rates(labels: np.ndarray, kept: np.ndarray) -> dict[str, Any]:
    """Precision and recall of `kept` as a "good" prediction, on the labelled documents."""
    labels = np.asarray(labels)
    kept = np.asarray(kept, dtype=bool)
    good, junk = labels == GOOD, labels == JUNK
    tp = int((kept & good).sum())
    fp = int((kept & junk).sum())
    return {
        "good": int(good.sum()),
        "junk": int(junk.sum()),
        "good_kept": tp / good.sum() if good.any() else float("nan"),  # recall
        "junk_dropped": 1 - fp / junk.sum() if junk.any() else float("nan"),
        "precision": tp / (tp + fp) if tp + fp else float("nan"),
    }


def read_pool(data: str | Path, params: Params, part: str = MEASURED) -> dict[str, list]:
    """The documents of DATA's pool in `part` (default: the measured part, never trained or tuned on)."""
    require_dataset(data)
    q = params.quality
    out: dict[str, list] = {"id": [], "text": [], "source": [], "kind": [], "path": []}
    for batch in iter_batches(data, columns=list(out)):
        ids = batch.column("id").to_pylist()
        sources = batch.column("source").to_pylist()
        parts = pool_parts(ids, q.negatives_share, q.dev_share, q.seed)
        for i, source in enumerate(sources):
            if source in POOL_LABELS and parts[i] == part:
                for name in out:
                    out[name].append(batch.column(name)[i].as_py())
    return out


def measure_tier1(docs: dict[str, list], params: Params, encoder: Encoder | None, scorer: Scorer,
                  source_labels: Mapping[str, int] = POOL_LABELS) -> dict[str, Any]:
    """Tier 1 on `docs` (see `read_pool`), measured against the provenance labels of `source_labels`.

    The heuristics run as the static stage runs them (`apply_by_source`); the
    head scores every document, survivors or not, so its AUC is the head's
    alone; tier 1 keeps a text document when both keep it. Documents of kind
    code are left out (tier 1 passes code to tier 3 unjudged).
    """
    static = params.static
    text_rows = [i for i, kind in enumerate(docs["kind"]) if kind == KIND_TEXT]
    texts = [docs["text"][i] for i in text_rows]
    sources = [docs["source"][i] for i in text_rows]
    labels = labels_by_source(sources, [len(t) for t in texts], source_labels)
    batch = pa.record_batch({
        "id": pa.array([docs["id"][i] for i in text_rows], pa.string()),
        "text": pa.array(texts, pa.large_string()),
        "kind": pa.array([KIND_TEXT] * len(texts), pa.string()),
        "source": pa.array(sources, pa.string()),
    })
    filters = build_heuristics(static.heuristics)
    chain = apply_by_source(filters, batch, static.source_rules)
    alone = {f.name: f.apply(batch).keep for f in filters}
    gopher = [f for f in filters if f.name.startswith("gopher_")]
    gopher_chain = apply_chain(gopher, batch).keep if gopher else None
    # A words head or a full classifier reads the text; only an embedding head needs the vectors.
    embeddings = encoder.encode(texts) if getattr(scorer, "needs_embeddings", False) else None
    quality = scorer.score(texts, embeddings) if texts else np.zeros(0)
    head_keep = quality >= static.threshold
    tier1 = chain.keep & head_keep
    labelled = labels != UNLABELLED
    per_source = {}
    for source in sorted(set(sources)):
        rows = np.array([s == source for s in sources])
        reasons = Counter(r for r, on in zip(chain.reason, rows) if on and r)
        per_source[source] = {
            "label": {GOOD: "good", JUNK: "junk"}.get(source_labels.get(source, UNLABELLED), "unlabelled"),
            "n": int(rows.sum()),
            "labelled": int((rows & labelled).sum()),
            "heuristics_keep": float(chain.keep[rows].mean()),
            "head_keep": float(head_keep[rows].mean()),
            "tier1_keep": float(tier1[rows].mean()),
            "head_median": float(np.median(quality[rows])),
            "top_reasons": reasons.most_common(3),
        }
    good = labels[labelled] == GOOD
    quantiles = {
        name: [float(v) for v in np.percentile(quality[labels == value], [10, 50, 90])] if (labels == value).any() else None
        for name, value in (("good", GOOD), ("junk", JUNK))
    }
    return {
        "documents": len(texts),
        "labelled": int(labelled.sum()),
        "code_left_out": len(docs["kind"]) - len(text_rows),
        "words": static.heuristics.words,
        "threshold": static.threshold,
        "heuristics": keep_rates(labels, chain.keep),
        "filters_alone": {name: keep_rates(labels, keep) for name, keep in alone.items()},
        "gopher_chain": keep_rates(labels, gopher_chain) if gopher_chain is not None else None,
        "head": {**keep_rates(labels, head_keep), "auc": roc_auc(good, quality[labelled]),
                 "ece": expected_calibration_error(calibration_table(good, quality[labelled])),
                 "score_p10_p50_p90": quantiles,
                 "auc_on_heuristic_survivors": roc_auc(labels[labelled & chain.keep] == GOOD,
                                                       quality[labelled & chain.keep])},
        "tier1": keep_rates(labels, tier1),
        "tier1_gopher_only": keep_rates(labels, gopher_chain & head_keep) if gopher_chain is not None else None,
        "per_source": per_source,
    }
