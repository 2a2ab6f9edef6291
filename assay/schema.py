"""The data contracts between stages (see ARCHITECTURE.md).

This module is the single owner of column names and types. Every stage
reads and writes through these schemas, so a change here is a change of
contract and must be made on purpose.
"""

from __future__ import annotations

import hashlib

import pyarrow as pa

# --- documents ---------------------------------------------------------------

#: The columns every dataset carries. Stages append score columns after these
#: and never rename or drop them.
DOCUMENT_SCHEMA = pa.schema(
    [
        pa.field("id", pa.string(), nullable=False),
        pa.field("text", pa.large_string(), nullable=False),
        pa.field("kind", pa.string(), nullable=False),  # "text" | "code"
        pa.field("lang", pa.string(), nullable=False),  # ISO code or programming language
        pa.field("source", pa.string(), nullable=False),
        pa.field("path", pa.string(), nullable=False),  # locator inside the source
        pa.field("meta", pa.string(), nullable=False),  # JSON object
    ]
)
DOCUMENT_COLUMNS: tuple[str, ...] = tuple(DOCUMENT_SCHEMA.names)

KIND_TEXT = "text"
KIND_CODE = "code"
KINDS = (KIND_TEXT, KIND_CODE)

#: Language code for natural-language text we could not identify.
LANG_UNKNOWN = "und"

# --- decisions ---------------------------------------------------------------

#: One row per input record of a stage, kept or dropped, so that
#: `assay why` can tell a document's whole story. `detail` carries what a
#: reason alone cannot (a line number, a parser message); `scores` holds the
#: numbers the stage based its decision on.
DECISION_SCHEMA = pa.schema(
    [
        pa.field("id", pa.string(), nullable=False),
        pa.field("stage", pa.string(), nullable=False),
        pa.field("kept", pa.bool_(), nullable=False),
        pa.field("reason", pa.string()),  # null when kept
        pa.field("scores", pa.map_(pa.string(), pa.float64())),
        pa.field("detail", pa.string()),
    ]
)

#: Reasons for bad input. Everything quarantined carries one of these.
INVALID_ENCODING = "invalid:encoding"
INVALID_BINARY = "invalid:binary"
INVALID_EMPTY = "invalid:empty"
INVALID_TOO_LARGE = "invalid:too_large"
INVALID_JSON = "invalid:json"
INVALID_IO = "invalid:io"
INVALID_RECORD = "invalid:record"  # well-formed JSON/row with a missing or non-text field
INVALID_DUPLICATE_ID = "invalid:duplicate_id"  # a record's own id, already given to an earlier record
INVALID_REASONS = (
    INVALID_ENCODING,
    INVALID_BINARY,
    INVALID_EMPTY,
    INVALID_TOO_LARGE,
    INVALID_JSON,
    INVALID_IO,
    INVALID_RECORD,
    INVALID_DUPLICATE_ID,
)

# --- quarantine --------------------------------------------------------------

#: The raw bytes of every quarantined record, so that nothing is lost: a
#: user can fix the encoding or the JSON and ingest them again. Records that
#: were too large or unreadable keep only their locator (`raw` is null); the
#: original is still at `source`/`path`.
QUARANTINE_SCHEMA = pa.schema(
    [
        pa.field("id", pa.string(), nullable=False),
        pa.field("source", pa.string(), nullable=False),
        pa.field("path", pa.string(), nullable=False),
        pa.field("reason", pa.string(), nullable=False),
        pa.field("detail", pa.string()),
        pa.field("raw", pa.large_binary()),
    ]
)


# --- telemetry ---------------------------------------------------------------
# Written by the trainer, one row per document per step; read back by the
# dynamic filter (the only coupling between training and filtering).
TELEMETRY_SCHEMA = pa.schema(
    [
        pa.field("step", pa.int64(), nullable=False),
        pa.field("sample_id", pa.string(), nullable=False),  # the document id
        pa.field("loss", pa.float32(), nullable=False),  # mean token loss of the document in this step
        pa.field("grad_norm", pa.float32()),  # norm of that loss's gradient; null when not computed
        pa.field("tokens", pa.int32(), nullable=False),  # its target tokens in this step
        pa.field("flagged", pa.bool_(), nullable=False),
        pa.field("reason", pa.string()),  # why flagged (e.g. skipped_step:loss_spike)
    ]
)


# --- embeddings --------------------------------------------------------------


def embedding_schema(dim: int) -> pa.Schema:
    """`embeddings/part-*.parquet`: one L2-normalised vector per document id."""
    return pa.schema(
        [
            pa.field("id", pa.string(), nullable=False),
            pa.field("vector", pa.list_(pa.float32(), dim), nullable=False),
        ]
    )


# --- ids ---------------------------------------------------------------------


def document_id(source: str, locator: str) -> str:
    """A stable id from where a record came from, never from batch position.

    The same source name and locator give the same id on every run and every
    machine; 128 bits make accidental collisions negligible at corpus scale.
    """
    digest = hashlib.blake2b(f"{source}\x1f{locator}".encode("utf-8"), digest_size=16)
    return digest.hexdigest()


def empty_documents() -> pa.Table:
    return DOCUMENT_SCHEMA.empty_table()


# --- scores ------------------------------------------------------------------
# Written by `assay score` (training.score), one row per document per scored checkpoint;
# read back by the dynamic filter and the report. A document without text has no row.
SCORE_SCHEMA = pa.schema(
    [
        pa.field("step", pa.int64(), nullable=False),  # the checkpoint's step
        pa.field("sample_id", pa.string(), nullable=False),  # the document id
        pa.field("kind", pa.string(), nullable=False),
        pa.field("lang", pa.string(), nullable=False),
        pa.field("tokens", pa.int32(), nullable=False),  # target tokens scored (of its first rows: see capped)
        pa.field("loss", pa.float32(), nullable=False),  # mean token loss over those tokens
        pa.field("grad_norm", pa.float32(), nullable=False),  # ||gradient of that loss||, all trainable params
        pa.field("grad_dot", pa.float32(), nullable=False),  # that gradient . its stratum's reference gradient
        pa.field("alignment", pa.float32(), nullable=False),  # their cosine
        pa.field("stratum", pa.string(), nullable=False),  # the reference stratum: "text", "code/python", "all"
        pa.field("ref_loss", pa.float32()),  # loss under score.reference_model (RHO-LOSS); null when none
        # (loss with each row's tokens shuffled - loss) / loss; null when score.order_rise is off
        pa.field("order_rise", pa.float32()),
        pa.field("reference", pa.bool_(), nullable=False),  # in the clean reference set: never judged
        pa.field("rows", pa.int32(), nullable=False),  # rows scored (at most score.max_rows)
        pa.field("capped", pa.bool_(), nullable=False),  # True when the document has more rows than that
    ]
)
