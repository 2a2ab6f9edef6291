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
  `models/X/modeling_X.py` whose `modular_X.py` beside it defines a class
  the modular converter routes to the modeling file (see
  `modular_writes_modeling`; amended in issue 10's second pass: the first
  rule, "a `modular_X.py` exists", also took `modeling_sam3.py`, whose
  modular file defines only `Sam3ImageProcessor`, so the converter writes
  `image_processing_sam3.py` from it and `modeling_sam3.py` is hand-written.
  The amended rule was written from the converter's routing, before the
  file's scores were looked at again); torch's autoheuristic
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

**The fresh split** (`FRESH`, issue 10's second pass). The evaluation split
was looked at when the first pass's misses were read, so its numbers are no
longer an unseen measurement. The fresh split holds only packages no earlier
split used, labelled here by provenance before any rule or score was run on
them. Registry artefacts, unmodified, are committed with their licences under
`tests/data/code/npm/` (`npm pack`) and `tests/data/code/pypi/` (wheels,
`pip download --no-deps`); the rest is site-packages packages no earlier
group read.
- Generated: marked's `lib/` (rollup bundles; `.d.ts`/`.d.cts` by
  dts-bundle-generator) and `marked.min.js`; tiny-invariant's, mitt's and
  eventemitter3's `dist/` (rollup / microbundle, with tsc's declarations;
  mitt's root `index.d.ts` is microbundle's emit); dayjs's `dayjs.min.js`,
  `locale/*.js` and `plugin/*.js` (rollup + babel + minifier); protoc's
  `*_pb2.py`/`*_pb2.pyi` and grpc_tools' `*_pb2_grpc.py` in grpcio-reflection;
  mypy-protobuf's `*_pb2.pyi` in types-protobuf; stix2-patterns' ANTLR
  `grammars/*.py`; calmjs.parse's PLY tables `parsers/lextab_*.py`,
  `parsers/yacctab_*.py`; phonenumbers' metadata `data/region_*.py`
  (`buildmetadatafromxml.py`); plotly's `graph_objs/` (plotly's `codegen/`);
  pendulum's `locales/*/locale.py` (pendulum's locale command, from CLDR).
- Hand-written: marked's `bin/`; tiny-invariant's `src/`; eventemitter3's
  `index.js`/`index.mjs`/`index.d.ts`; dayjs's `.d.ts` files (copied from its
  hand-written `types/`); p-limit; commander (`lib/`, `typings/`,
  `esm.mjs`); express (`lib/`, `index.js`); DefinitelyTyped's `@types/react`
  and `@types/express-serve-static-core`; grpcio-reflection's modules;
  types-protobuf's typeshed stubs (every `.pyi` but `*_pb2.pyi`); ply;
  stix2-patterns' and calmjs.parse's other modules (tests left out);
  phonenumbers' top-level modules and stubs (`unicode_util` left out: a
  generated table); plotly's `express/` and `io/`, pendulum's modules
  (locales left out); cryptography's `.pyi` stubs; aiohttp, kombu, celery,
  markdown_it, dulwich, griffe, loguru, tqdm, websockets, yarl, typer.
- Left out: dayjs's `esm/*.js` (babel's per-module transpilation of
  hand-written sources, as underscore's `amd/`/`cjs/` above).

The calibration split also gained packages in that pass (never in the
evaluation split), so the new signatures had examples to be checked on:
redux (rollup's `lib/`/`es/`/`dist/` generated; `src/` and its hand-written
root `index.d.ts`), zod's `lib/` (tsc and rollup output), DefinitelyTyped's
`@types/lodash` (hand-written, but for `fp.d.ts`, which its header says
`scripts/generate-fp.ts` writes: amended after the first rules run on the
calibration split), grpcio-health-checking (protoc, grpc_tools;
its other modules hand-written) and numpy's hand-written `.pyi` stubs.
"""

from __future__ import annotations

import fnmatch
import hashlib
import random
import re
import sysconfig
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from assay.languages import language_from_path
from assay.schema import KIND_CODE

GENERATED, HAND_WRITTEN = "generated", "hand-written"
CALIBRATION, EVALUATION, FRESH = "calibration", "evaluation", "fresh"
MIN_CHARS = 500
MAX_BYTES = 1 << 20
SEED = 0
ROOT = Path(__file__).resolve().parents[2]
NPM_DIR = ROOT / "tests" / "data" / "code" / "npm"
WHEEL_DIR = ROOT / "tests" / "data" / "code" / "pypi"

_CODEC = re.compile(r"(cp\d+|mac_\w+|iso8859_\d+|koi8_\w+|hp_roman8|palmos|ptcp154|tis_620|kz1048)\.py")
_CODEC_HAND = {"cp932.py", "cp949.py", "cp950.py", "cp65001.py"}


@dataclass(frozen=True)
class Group:
    """A provenance group: where its files are, their label, and how many to take."""

    name: str
    label: str
    root: str  # "stdlib", "site", "npm:<tarball stem>" or "whl:<wheel stem>"
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
#: Hand-written Python packages of the fresh split (site-packages no earlier group read).
FRESH_HAND_PY = ("aiohttp", "kombu", "celery", "markdown_it", "dulwich", "griffe", "loguru", "tqdm", "websockets",
                 "yarl", "typer")

GROUPS: tuple[Group, ...] = (
    # Generated, Python.
    _gen("codec-cp", "stdlib", ["encodings/cp*.py"]),
    _gen("codec-other", "stdlib", ["encodings/mac_*.py", "encodings/iso8859_*.py", "encodings/koi8_*.py",
                                   "encodings/hp_roman8.py", "encodings/palmos.py", "encodings/ptcp154.py",
                                   "encodings/tis_620.py", "encodings/kz1048.py"]),
    _gen("idna-data", "site", ["idna/uts46data.py", "idna/idnadata.py"]),
    _gen("wcwidth-tables", "site", ["wcwidth/table_*.py"]),
    _gen("pygments-tables", "site", ["pygments/*/_mapping.py", "pygments/lexers/_*_builtins.py"]),
    # protobuf's own modules only: the set must not change when an optional extra (Ray pulls in
    # googleapis-common-protos and opentelemetry-proto) adds generated modules to site-packages.
    _gen("protobuf-google", "site", ["google/protobuf/*_pb2.py", "google/protobuf/*_pb2.pyi",
                                     "google/protobuf/*_pb2_grpc.py"]),
    _gen("protobuf-weaviate", "site", ["weaviate/*_pb2.py", "weaviate/*_pb2.pyi", "weaviate/*_pb2_grpc.py"]),
    _gen("protobuf-other", "site", ["transformers/*_pb2.py", "grpc/*_pb2.py"]),
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
    # Issue 10's second pass, calibration split (see "The fresh split" above).
    _gen("npm-redux", "npm:redux-4.2.1", ["lib/*", "es/*", "dist/*"]),
    _gen("npm-zod", "npm:zod-3.23.8", ["lib/*"]),
    _gen("whl-grpc-health-gen", "whl:grpcio_health_checking-1.66.2-py3-none-any",
         ["*_pb2.py", "*_pb2.pyi", "*_pb2_grpc.py"]),
    _hand("npm-redux-src", "npm:redux-4.2.1", ["src/*", "index.d.ts"]),
    _hand("npm-types-lodash", "npm:types-lodash-4.17.13", ["*.d.ts"], ["fp.d.ts", "fp/*"]),
    # Amended after the first rules run on the calibration split flagged it among the hand-written:
    # its header names its generator (types/lodash/scripts/generate-fp.ts).
    _gen("npm-types-lodash-fp", "npm:types-lodash-4.17.13", ["fp.d.ts"]),
    _hand("whl-grpc-health-src", "whl:grpcio_health_checking-1.66.2-py3-none-any", ["*.py"], GENERATED_PY),
    _hand("py-numpy-stubs", "site", ["numpy/*.pyi"]),
    # Issue 10's second pass: the fresh split, labelled before any score (see above).
    _gen("fresh-npm-marked", "npm:marked-12.0.2", ["lib/*", "marked.min.js"]),
    _gen("fresh-npm-tiny-invariant", "npm:tiny-invariant-1.3.3", ["dist/*"]),
    _gen("fresh-npm-mitt", "npm:mitt-3.0.1", ["dist/*", "index.d.ts"]),
    _gen("fresh-npm-eventemitter3", "npm:eventemitter3-5.0.1", ["dist/*"]),
    _gen("fresh-npm-dayjs", "npm:dayjs-1.11.13", ["dayjs.min.js", "locale/*.js", "plugin/*.js"], cap=30),
    _gen("fresh-whl-grpc-reflection-gen", "whl:grpcio_reflection-1.66.2-py3-none-any",
         ["*_pb2.py", "*_pb2.pyi", "*_pb2_grpc.py"]),
    _gen("fresh-whl-types-protobuf-gen", "whl:types_protobuf-5.28.3.20241030-py3-none-any", ["*_pb2.pyi"]),
    _gen("fresh-whl-stix2-antlr", "whl:stix2_patterns-2.0.0-py2.py3-none-any", ["*/grammars/*.py"],
         ["*/__init__.py"]),
    _gen("fresh-whl-calmjs-ply", "whl:calmjs.parse-1.3.1-py3-none-any",
         ["calmjs/parse/parsers/lextab_*.py", "calmjs/parse/parsers/yacctab_*.py"]),
    _gen("fresh-whl-phonenumbers-data", "whl:phonenumberslite-8.13.50-py2.py3-none-any",
         ["phonenumbers/data/region_*.py"], cap=30),
    _gen("fresh-plotly-codegen", "site", ["plotly/graph_objs/*.py"], ["*/__init__.py"], cap=30),
    _gen("fresh-pendulum-locales", "site", ["pendulum/locales/*/locale.py"], cap=30),
    _hand("fresh-npm-marked-bin", "npm:marked-12.0.2", ["bin/*"]),
    _hand("fresh-npm-tiny-invariant-src", "npm:tiny-invariant-1.3.3", ["src/*"]),
    _hand("fresh-npm-eventemitter3-src", "npm:eventemitter3-5.0.1", ["index.js", "index.mjs", "index.d.ts"]),
    _hand("fresh-npm-dayjs-types", "npm:dayjs-1.11.13", ["*.d.ts"]),
    _hand("fresh-npm-p-limit", "npm:p-limit-6.2.0", ["index.js", "index.d.ts"]),
    _hand("fresh-npm-commander", "npm:commander-12.1.0", ["lib/*", "typings/*", "esm.mjs", "index.js"]),
    _hand("fresh-npm-express", "npm:express-4.21.2", ["lib/*", "index.js"]),
    _hand("fresh-npm-types-react", "npm:types-react-18.3.12", ["*.d.ts"]),
    _hand("fresh-npm-types-express", "npm:types-express-serve-static-core-5.0.6", ["*.d.ts"]),
    _hand("fresh-whl-grpc-reflection-src", "whl:grpcio_reflection-1.66.2-py3-none-any", ["*.py"], GENERATED_PY),
    _hand("fresh-whl-types-protobuf-stubs", "whl:types_protobuf-5.28.3.20241030-py3-none-any", ["*.pyi"],
          ["*_pb2.pyi"]),
    _hand("fresh-whl-ply", "whl:ply-3.11-py2.py3-none-any", ["ply/*.py"]),
    _hand("fresh-whl-stix2-src", "whl:stix2_patterns-2.0.0-py2.py3-none-any", ["stix2patterns/*.py"],
          ["*/grammars/*", "*/test/*"]),
    _hand("fresh-whl-calmjs-src", "whl:calmjs.parse-1.3.1-py3-none-any", ["calmjs/*.py"],
          ["*/parsers/lextab_*", "*/parsers/yacctab_*", "*/tests/*"]),
    _hand("fresh-whl-phonenumbers-src", "whl:phonenumberslite-8.13.50-py2.py3-none-any",
          ["phonenumbers/*.py", "phonenumbers/*.pyi"], ["phonenumbers/data/*", "phonenumbers/shortdata/*",
                                                        "phonenumbers/unicode_util.py*"]),
    _hand("fresh-py-plotly", "site", ["plotly/express/*.py", "plotly/io/*.py"], GENERATED_PY),
    _hand("fresh-py-pendulum", "site", ["pendulum/*.py"], GENERATED_PY + ("pendulum/locales/*",)),
    _hand("fresh-py-cryptography-stubs", "site", ["cryptography/*.pyi"]),
    *(_hand(f"fresh-py-{pkg}", "site", [f"{pkg}/*.py"], GENERATED_PY) for pkg in FRESH_HAND_PY),
)

#: Groups whose files thresholds may be tuned on; every other group is the evaluation split.
CALIBRATION_GROUPS = frozenset(
    {"codec-cp", "wcwidth-tables", "protobuf-google", "antlr-hydra", "dateparser-data", "torch-autoheuristic",
     "jinja2-identifier", "npm-d3", "npm-jquery", "npm-rxjs", "npm-d3-src", "npm-jquery-src", "npm-rxjs-src",
     "npm-redux", "npm-zod", "whl-grpc-health-gen", "npm-redux-src", "npm-types-lodash", "npm-types-lodash-fp",
     "whl-grpc-health-src",
     "py-numpy-stubs"}
    | {f"py-{pkg}" for pkg, split in HAND_PY if split == CALIBRATION}
)
#: Groups of the fresh split (issue 10's second pass): packages no other split used.
FRESH_GROUPS = frozenset(g.name for g in GROUPS if g.name.startswith("fresh-"))


def split_of(group: str) -> str:
    """The split a group's files belong to."""
    if group in CALIBRATION_GROUPS:
        return CALIBRATION
    return FRESH if group in FRESH_GROUPS else EVALUATION

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
            # The tarball's top folder is "package/", or the package's name for @types.
            yield member.name.split("/", 1)[-1], (lambda d=data: d), member.size


def _wheel_files(stem: str):
    with zipfile.ZipFile(WHEEL_DIR / f"{stem}.whl") as wheel:
        for info in sorted(wheel.infolist(), key=lambda i: i.filename):
            if not info.is_dir() and ".dist-info/" not in info.filename:
                yield info.filename, (lambda n=info.filename: wheel.read(n)), info.file_size


#: Class-name endings transformers' modular converter routes to a file other than `modeling_X.py`
#: (its `utils/modular_model_converter.py`: configuration, tokenization, (image/video) processing,
#: including the fast and PIL image processors, feature extraction, and the processors' kwargs
#: classes); every other class goes to the modeling file. Checked against the converter's own
#: output: for each of the installed transformers' 331 modeling files with a modular file, this
#: rule says "generated" exactly when the modeling file carries the converter's banner.
_MODULAR_NON_MODELING = re.compile(
    r"(?:Config|Tokenizer|TokenizerFast|Processor|ProcessorFast|ProcessorPil|FeatureExtractor|Kwargs)$")


def modular_writes_modeling(modular_source: str) -> bool:
    """Whether transformers' modular converter writes `modeling_X.py` from this `modular_X.py`.

    It does when the modular file defines a top-level class that the converter
    routes to the modeling file (by its name: not a config, tokenizer,
    processor, feature extractor or processor kwargs class).
    """
    names = re.findall(r"(?m)^class\s+(\w+)", modular_source)
    return any(not _MODULAR_NON_MODELING.search(name) for name in names)


def _candidates(group: Group) -> list[tuple[str, bytes]]:
    if group.root == "stdlib":
        source = _stdlib_files(group)
    elif group.root == "site":
        source = _site_files(group)
    elif group.root.startswith("whl:"):
        source = _wheel_files(group.root.removeprefix("whl:"))
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
            if not modular.is_file() or not modular_writes_modeling(modular.read_text("utf-8")):
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
        split = split_of(group.name)
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
