"""A labelled set of real code for measuring tier 3: generated or hand-written, by provenance.

The labels come from where a file came from and which tool wrote it, never
from tier 3's rules or scores. They were written down here, in `GROUPS`,
before any score was computed on the files. Every machine of this project's
kind has the sources: the Python standard library, the project's virtual
environment (site-packages), and seven npm packages committed as their
registry tarballs under `tests/data/code/npm/` (each with its licence file).

**Generated** (the generator is named per group):
- single-byte charmap codecs `encodings/{cp*,mac_*,iso8859_*,koi8_*,...}.py`
  (CPython's `Tools/unicode/gencodec.py`; the hand-written multibyte wrappers
  cp932/cp949/cp950 and cp65001 are excluded);
- Unicode/IDNA data modules `idna/{uts46data,idnadata}.py` (idna's
  `tools/idna-data`) and wcwidth's `table_*.py` (its `bin/update-tables.py`);
- lexer tables `pygments/{lexers,styles,formatters}/_mapping.py` and
  `pygments/lexers/_*_builtins.py` (Pygments' `scripts/gen_mapfiles.py` and
  each module's own `__main__` regenerator);
- protocol buffers `*_pb2.py`, `*_pb2.pyi`, `*_pb2_grpc.py` (protoc, grpc_tools);
- ANTLR parsers `hydra/grammar/gen/`, `omegaconf/grammar/gen/`,
  `sympy/parsing/*/_antlr/`; pycparser's `c_ast.py` (from `_c_ast.cfg`);
- dateparser's locale data `dateparser/data/date_translation_data/*.py`
  (its `dateparser_scripts/write_complete_data.py`, from CLDR);
- transformers: `utils/dummy_*_objects.py` (`make fix-copies`) and every
  `models/X/modeling_X.py` that has a `modular_X.py` beside it (the modular
  converter writes the former from the latter); torch's autoheuristic
  `artifacts/_*.py` (learned decision trees written by AutoHeuristic);
- amended after the first run of the rules (which flagged them among the
  hand-written files; their headers name the generator script):
  `rich/_unicode_data/unicode*.py` (rich's `tools/make_width_tables.py`) and
  `jinja2/_identifier.py` (`scripts/generate_identifier_pattern.py`);
- npm: `*.min.js` / `*-min.js`, everything under `dist/` (rollup/esbuild/tsc
  bundles and per-module compiler output, including `.d.ts`), and
  underscore's root bundles `underscore-umd.js`, `underscore-node*.cjs`,
  `underscore-esm.js`, `underscore.js` (rollup, per its package.json);
  Prefect's UI bundles `prefect/server/ui*/assets/*.js` (vite).

**Hand-written**: ordinary modules of the site-packages packages listed in
`HAND_PY` that match none of the generated patterns, and the npm packages'
source directories (`src/`, `lib/`, underscore's `modules/`), in JavaScript
and TypeScript.

Left out on purpose: underscore's `amd/` and `cjs/` (rollup's per-module
transpilation of `modules/`, content-identical to hand-written CommonJS/AMD
apart from the import syntax; no content rule could tell them apart, and a
path rule would just restate the label), vendored copies under
`pip/_vendor/` (duplicates), files under `MIN_CHARS` characters (empty
`__init__.py` files and stubs say nothing about their provenance), files over
`MAX_BYTES`, and exact duplicates (the first in order is kept).

**Splits** are by package or source, never by file, so thresholds tuned on
the calibration split are reported on packages they never saw: see
`CALIBRATION_GROUPS`. Each group is capped (`cap`) with a seeded sample, so no
single package dominates.
"""

from __future__ import annotations

import fnmatch
import hashlib
import random
import re
import sysconfig
import tarfile
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from assay.languages import language_from_path
from assay.schema import KIND_CODE

GENERATED, HAND_WRITTEN = "generated", "hand-written"
CALIBRATION, EVALUATION = "calibration", "evaluation"
MIN_CHARS = 500
MAX_BYTES = 1 << 20
SEED = 0
ROOT = Path(__file__).resolve().parents[2]
NPM_DIR = ROOT / "tests" / "data" / "code" / "npm"

_CODEC = re.compile(r"(cp\d+|mac_\w+|iso8859_\d+|koi8_\w+|hp_roman8|palmos|ptcp154|tis_620|kz1048)\.py")
_CODEC_HAND = {"cp932.py", "cp949.py", "cp950.py", "cp65001.py"}


@dataclass(frozen=True)
class Group:
    """A provenance group: where its files are, their label, and how many to take."""

    name: str
    label: str
    root: str  # "stdlib", "site" or "npm:<tarball stem>"
    include: tuple[str, ...]  # fnmatch patterns on the path under root
    exclude: tuple[str, ...] = ()
    cap: int = 40


def _gen(name, root, include, exclude=(), cap=40) -> Group:
    return Group(name, GENERATED, root, tuple(include), tuple(exclude), cap)


def _hand(name, root, include, exclude=(), cap=25) -> Group:
    return Group(name, HAND_WRITTEN, root, tuple(include), tuple(exclude), cap)


#: Patterns of generated Python anywhere in site-packages: never sampled as hand-written.
GENERATED_PY = ("*_pb2.py", "*_pb2.pyi", "*_pb2_grpc.py", "*/grammar/gen/*", "*/_antlr/*", "*/_mapping.py",
                "*/_*_builtins.py", "idna/uts46data.py", "idna/idnadata.py", "wcwidth/table_*.py",
                "pycparser/c_ast.py", "*/date_translation_data/*", "*/dummy_*_objects.py",
                "*/autoheuristic/artifacts/*", "*/_version.py", "*/version.py",
                # Amended after the first run of the rules, which flagged them among the
                # hand-written: their provenance is a generator script (named in their header).
                "rich/_unicode_data/*", "jinja2/_identifier.py")

#: Hand-written Python packages: (package, split). The split is by package.
HAND_PY: tuple[tuple[str, str], ...] = (
    ("click", CALIBRATION), ("jinja2", CALIBRATION), ("requests", CALIBRATION), ("packaging", CALIBRATION),
    ("markdown", CALIBRATION), ("tomlkit", CALIBRATION), ("yaml", CALIBRATION), ("attr", CALIBRATION),
    ("urllib3", CALIBRATION), ("networkx", CALIBRATION),
    ("httpx", EVALUATION), ("h11", EVALUATION), ("anyio", EVALUATION), ("pydantic", EVALUATION),
    ("sqlalchemy", EVALUATION), ("dateutil", EVALUATION), ("pyparsing", EVALUATION),
    ("jsonschema", EVALUATION), ("prompt_toolkit", EVALUATION), ("fsspec", EVALUATION),
    ("alembic", EVALUATION), ("mako", EVALUATION), ("starlette", EVALUATION), ("rich", EVALUATION),
    ("dvc", EVALUATION), ("pygments", EVALUATION), ("idna", EVALUATION),
)

GROUPS: tuple[Group, ...] = (
    # Generated, Python.
    _gen("codec-cp", "stdlib", ["encodings/cp*.py"]),
    _gen("codec-other", "stdlib", ["encodings/mac_*.py", "encodings/iso8859_*.py", "encodings/koi8_*.py",
                                   "encodings/hp_roman8.py", "encodings/palmos.py", "encodings/ptcp154.py",
                                   "encodings/tis_620.py", "encodings/kz1048.py"]),
    _gen("idna-data", "site", ["idna/uts46data.py", "idna/idnadata.py"]),
    _gen("wcwidth-tables", "site", ["wcwidth/table_*.py"]),
    _gen("pygments-tables", "site", ["pygments/*/_mapping.py", "pygments/lexers/_*_builtins.py"]),
    _gen("protobuf-google", "site", ["google/*_pb2.py", "google/*_pb2.pyi", "google/*_pb2_grpc.py"]),
    _gen("protobuf-weaviate", "site", ["weaviate/*_pb2.py", "weaviate/*_pb2.pyi", "weaviate/*_pb2_grpc.py"]),
    _gen("protobuf-other", "site", ["transformers/*_pb2.py", "opentelemetry/*_pb2.py", "grpc/*_pb2.py"]),
    _gen("antlr-hydra", "site", ["hydra/grammar/gen/*.py"]),
    _gen("antlr-omegaconf-sympy", "site", ["omegaconf/grammar/gen/*.py", "sympy/parsing/*/_antlr/*.py"]),
    _gen("pycparser-ast", "site", ["pycparser/c_ast.py"]),
    _gen("dateparser-data", "site", ["dateparser/data/date_translation_data/*.py"], cap=30),
    _gen("transformers-generated", "site", ["transformers/utils/dummy_*_objects.py", "transformers/models/*/modeling_*.py"],
         cap=30),
    _gen("torch-autoheuristic", "site", ["torch/_inductor/autoheuristic/artifacts/_*.py"]),
    # Amended (see GENERATED_PY): rich's tools/make_width_tables.py, jinja2's
    # scripts/generate_identifier_pattern.py.
    _gen("rich-unicode-data", "site", ["rich/_unicode_data/unicode*.py"], cap=20),
    _gen("jinja2-identifier", "site", ["jinja2/_identifier.py"]),
    # Generated, JavaScript/TypeScript.
    _gen("npm-d3", "npm:d3-array-3.2.4", ["dist/*"]),
    _gen("npm-d3-scale", "npm:d3-scale-4.0.2", ["dist/*"]),
    _gen("npm-jquery", "npm:jquery-3.7.1", ["dist/*"]),
    _gen("npm-underscore", "npm:underscore-1.13.8", ["*-min.js", "underscore-umd.js", "underscore-node*.cjs",
                                                    "underscore-esm.js", "underscore.js"]),
    _gen("npm-axios", "npm:axios-1.21.1", ["dist/*"]),
    _gen("npm-immer", "npm:immer-10.1.1", ["dist/*"]),
    _gen("npm-rxjs", "npm:rxjs-7.8.2", ["dist/*"], cap=30),
    _gen("prefect-ui", "site", ["prefect/server/ui/assets/*.js", "prefect/server/ui-v2/assets/*.js"], cap=30),
    # Hand-written, JavaScript/TypeScript.
    _hand("npm-d3-src", "npm:d3-array-3.2.4", ["src/*"]),
    _hand("npm-d3-scale-src", "npm:d3-scale-4.0.2", ["src/*"]),
    _hand("npm-jquery-src", "npm:jquery-3.7.1", ["src/*"]),
    _hand("npm-underscore-src", "npm:underscore-1.13.8", ["modules/*"]),
    _hand("npm-axios-src", "npm:axios-1.21.1", ["lib/*"]),
    _hand("npm-immer-src", "npm:immer-10.1.1", ["src/*"]),
    _hand("npm-rxjs-src", "npm:rxjs-7.8.2", ["src/*"]),
    # Hand-written, Python: one group per package.
    *(_hand(f"py-{pkg}", "site", [f"{pkg}/*.py"], GENERATED_PY) for pkg, _ in HAND_PY),
)

#: Groups whose files thresholds may be tuned on; every other group is the evaluation split.
CALIBRATION_GROUPS = frozenset(
    {"codec-cp", "wcwidth-tables", "protobuf-google", "antlr-hydra", "dateparser-data", "torch-autoheuristic",
     "jinja2-identifier", "npm-d3", "npm-jquery", "npm-rxjs", "npm-d3-src", "npm-jquery-src", "npm-rxjs-src"}
    | {f"py-{pkg}" for pkg, split in HAND_PY if split == CALIBRATION}
)

_CODE_EXT = (".py", ".pyi", ".js", ".mjs", ".cjs", ".ts", ".mts", ".cts")


@dataclass
class LabelledFile:
    path: str  # "<root>/<path under it>"
    text: str
    lang: str
    label: str
    group: str
    split: str


def _stdlib_files(group: Group):
    base = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(base.rglob("*")):
        rel = path.relative_to(base).as_posix()
        if path.is_file() and "__pycache__" not in rel:
            if group.name.startswith("codec") and (path.name in _CODEC_HAND or not _CODEC.fullmatch(path.name)):
                continue
            yield rel, path.read_bytes, path.stat().st_size


def _site_files(group: Group):
    base = Path(sysconfig.get_paths()["purelib"])
    for pattern in group.include:
        top = pattern.split("/", 1)[0]
        tops = [base / top] if "*" not in top else [base]
        for start in tops:
            if not start.exists():
                continue
            for path in sorted(start.rglob("*")):
                rel = path.relative_to(base).as_posix()
                if path.is_file() and "__pycache__" not in rel and not rel.startswith("pip/_vendor/"):
                    yield rel, path.read_bytes, path.stat().st_size


def _npm_files(stem: str):
    with tarfile.open(NPM_DIR / f"{stem}.tgz") as tar:
        members = sorted((m for m in tar.getmembers() if m.isfile()), key=lambda m: m.name)
        for member in members:
            data = tar.extractfile(member).read()
            yield member.name.removeprefix("package/"), (lambda d=data: d), member.size


def _candidates(group: Group) -> list[tuple[str, bytes]]:
    if group.root == "stdlib":
        source = _stdlib_files(group)
    elif group.root == "site":
        source = _site_files(group)
    else:
        source = _npm_files(group.root.removeprefix("npm:"))
    out, seen = [], set()
    for rel, read, size in source:
        if rel in seen or not rel.endswith(_CODE_EXT) or size > MAX_BYTES:
            continue
        if not any(fnmatch.fnmatch(rel, p) for p in group.include) or any(fnmatch.fnmatch(rel, p) for p in group.exclude):
            continue
        if group.name == "transformers-generated" and "/modeling_" in rel:
            folder, name = rel.rsplit("/", 1)
            modular = Path(sysconfig.get_paths()["purelib"]) / folder / name.replace("modeling_", "modular_", 1)
            if not modular.is_file():
                continue
        seen.add(rel)
        out.append((rel, read()))
    return out


def build_labelled_set(seed: int = SEED) -> list[LabelledFile]:
    """The labelled files, in a fixed order; the same on every machine with the same installation."""
    files: list[LabelledFile] = []
    digests: set[bytes] = set()
    for group in GROUPS:
        rows = []
        for rel, data in _candidates(group):
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError:
                continue
            lang = language_from_path(rel)
            if lang is None or len(text) < MIN_CHARS:
                continue
            rows.append((rel, text, lang))
        rng = random.Random(f"{seed}:{group.name}")
        if len(rows) > group.cap:
            rows = sorted(rng.sample(rows, group.cap))
        split = CALIBRATION if group.name in CALIBRATION_GROUPS else EVALUATION
        for rel, text, lang in rows:
            digest = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()
            if digest in digests:
                continue
            digests.add(digest)
            files.append(LabelledFile(f"{group.root}/{rel}", text, lang, group.label, group.name, split))
    return files


def as_batch(files: list[LabelledFile]) -> pa.RecordBatch:
    """The files as a document batch (the project's schema's columns) for the stage to judge."""
    ids = [hashlib.blake2b(f.path.encode(), digest_size=8).hexdigest() for f in files]
    return pa.RecordBatch.from_arrays(
        [pa.array(ids, pa.string()), pa.array([f.text for f in files], pa.large_string()),
         pa.array([KIND_CODE] * len(files), pa.string()), pa.array([f.lang for f in files], pa.string()),
         pa.array([f.group for f in files], pa.string()), pa.array([f.path for f in files], pa.string()),
         pa.array(["{}"] * len(files), pa.string())],
        names=["id", "text", "kind", "lang", "source", "path", "meta"])
