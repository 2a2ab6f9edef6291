"""Benchmark: tier 3's code rules, language ID, parsing and domain model, on real source files.

    .venv/bin/python bench/domain.py [--files 1000] [--seed 0] [--model models/domain]

The sample is source this machine has: the Python standard library,
site-packages (Python, Cython, C/C++ headers and sources, JavaScript
including Prefect's UI bundles, JSON, YAML, CSS, SVG, Fortran, CMake...) and
/usr/include, drawn per extension with a fixed seed (files over 1 MB or not
UTF-8 are left out). Rows are labelled as ingest labels them
(`assay.languages.classify_batch`). Each step runs single-threaded over one
Arrow batch:

- rules: `CodeRulesFilter.apply`;
- language ID: `identify_languages` (names, shebangs, content checks);
- parsing: `SyntaxFilter.apply` (tree-sitter for every language with a
  grammar, plus `ast.parse` for Python);
- the domain model: per-token perplexity of the files in the languages the
  model knows (when `--model` exists; `make demo` trains it).

It prints a markdown table of documents/s and MB/s (UTF-8 bytes), then what
each rule drops, what parsing drops, and which labels language ID changed.
"""

from __future__ import annotations

import argparse
import random
import sys
import sysconfig
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

#: Extension → share of the sample (what is available fills the rest with Python).
QUOTAS: dict[str, float] = {
    ".py": 0.40, ".h": 0.12, ".hpp": 0.03, ".c": 0.04, ".cpp": 0.03, ".cc": 0.02, ".cuh": 0.02,
    ".js": 0.08, ".json": 0.04, ".yaml": 0.04, ".pyi": 0.03, ".pyx": 0.03, ".f90": 0.02,
    ".cmake": 0.02, ".css": 0.02, ".svg": 0.01, ".sh": 0.01, ".toml": 0.01, ".html": 0.01,
}
MAX_BYTES = 1 << 20


def sample_files(n: int = 1000, seed: int = 0) -> list[Path]:
    roots = [Path(sysconfig.get_paths()["stdlib"]), Path(sysconfig.get_paths()["purelib"]), Path("/usr/include")]
    by_ext: dict[str, list[Path]] = {}
    seen: set[Path] = set()
    for root in roots:
        if not root.is_dir():
            continue
        for path in root.rglob("*"):
            ext = path.suffix.lower()
            if ext not in QUOTAS or "__pycache__" in path.parts:
                continue
            try:
                real = path.resolve()
                if real in seen or not path.is_file() or path.stat().st_size > MAX_BYTES:
                    continue
            except OSError:
                continue
            seen.add(real)
            by_ext.setdefault(ext, []).append(path)
    rng = random.Random(seed)
    chosen: list[Path] = []
    for ext, share in QUOTAS.items():
        pool = sorted(by_ext.get(ext, []))
        chosen += rng.sample(pool, min(len(pool), max(1, round(share * n))))
    rest = sorted(set(by_ext.get(".py", [])) - set(chosen))
    chosen += rng.sample(rest, max(0, min(len(rest), n - len(chosen))))
    return chosen[:n]


def load(paths: list[Path]):
    import pyarrow as pa

    from assay.languages import classify_batch

    texts, names = [], []
    for path in paths:
        try:
            texts.append(path.read_text("utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
        names.append(str(path))
    text = pa.array(texts, pa.large_string())
    path_array = pa.array(names, pa.string())
    kinds, langs = classify_batch(text, path_array)
    return pa.record_batch({
        "id": pa.array([f"f{i}" for i in range(len(texts))]),
        "text": text, "kind": kinds, "lang": langs, "source": pa.array(["bench"] * len(texts)),
        "path": path_array, "meta": pa.array(["{}"] * len(texts)),
    })


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default="models/domain",
                        help="domain model for the perplexity row (made by `make demo` or `assay domain train`)")
    args = parser.parse_args(argv)

    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    from assay.config import DomainParams
    from filters.code_langid import identify_languages
    from filters.code_rules import CodeRulesFilter, code_features, rule_clean_flags, rule_failures
    from filters.code_syntax import SyntaxFilter

    batch = load(sample_files(args.files, args.seed))
    n = batch.num_rows
    mb = sum(pc.binary_length(batch.column("text").cast("large_binary")).to_pylist()) / 1e6
    langs_in = Counter(batch.column("lang").to_pylist())
    print(f"sample: {n} files, {mb:.1f} MB; languages: "
          + ", ".join(f"{k} {v}" for k, v in langs_in.most_common()) + "\n")

    params = DomainParams()
    rules = CodeRulesFilter(params.rules)
    syntax = SyntaxFilter(params)
    rows = []
    t0 = time.perf_counter()
    rule_result = rules.apply(batch)
    rows.append(("rules (CodeRulesFilter)", time.perf_counter() - t0))
    t0 = time.perf_counter()
    langs, changed = identify_languages(batch, params)
    rows.append(("language ID (identify_languages)", time.perf_counter() - t0))
    # The stage parses with the corrected labels.
    labelled = batch.set_column(batch.schema.get_field_index("lang"), "lang", pa.array(langs, pa.string()))
    t0 = time.perf_counter()
    syntax_result = syntax.apply(labelled)
    rows.append(("parsing (SyntaxFilter)", time.perf_counter() - t0))
    if Path(args.model).is_dir():
        from assay.config import DomainModelParams
        from assay.domain.perplexity import PerplexityScorer

        scorer = PerplexityScorer(DomainModelParams(model=args.model))
        screened = [t for t, lang in zip(batch.column("text").to_pylist(), langs) if scorer.screens(lang)]
        screened_mb = sum(len(t.encode("utf-8", "surrogatepass")) for t in screened) / 1e6
        t0 = time.perf_counter()
        scorer.perplexity(screened)
        seconds = time.perf_counter() - t0
        model_row = (f"domain model perplexity ({len(screened)} {'/'.join(scorer.languages or ['all'])} files, "
                     f"first {scorer.window} tokens)", seconds, len(screened), screened_mb)
    else:
        model_row = None
        print(f"(no domain model at {args.model}: run `make demo` or `assay domain train` for the model row)\n")

    print("| step | seconds | documents/s | MB/s |")
    print("|---|---:|---:|---:|")
    for name, seconds in rows:
        print(f"| {name} | {seconds:.2f} | {n / seconds:,.0f} | {mb / seconds:.1f} |")
    if model_row:
        name, seconds, docs, docs_mb = model_row
        print(f"| {name} | {seconds:.2f} | {docs / seconds:,.0f} | {docs_mb / seconds:.1f} |")

    print("\nfirst failing rule (the reason given):")
    for reason, count in Counter(r for r in rule_result.reason if r).most_common():
        print(f"  {reason}: {count}")
    print("each rule on its own:")
    features = code_features(batch, params.rules)
    for rule, failed in rule_failures(features, params.rules):
        extra = f" ({int((failed & (features.chars == 0)).sum())} of them empty files)" if rule == "alpha_fraction" else ""
        print(f"  {rule}: {int(failed.sum())}{extra}")
    ratio = syntax_result.scores["code_syntax:error_ratio"]
    ast_ok = syntax_result.scores["code_syntax:python_ast_ok"]
    print(f"\nparsing: {int((~np.isnan(ratio)).sum())} parsed, {int((ratio > 0).sum())} with an error node, "
          f"{int((~syntax_result.keep).sum())} dropped (ratio > {params.max_parse_error_ratio} or ast fails; "
          f"{int((ast_ok == 0).sum())} Python files rejected by ast)")
    by_lang = Counter()
    for i in np.flatnonzero(~syntax_result.keep).tolist():
        by_lang[langs[i]] += 1
    if by_lang:
        print("  dropped by language: " + ", ".join(f"{k} {v}" for k, v in by_lang.most_common()))
    old = batch.column("lang").to_pylist()
    moves = Counter((old[i], langs[i]) for i in np.flatnonzero(changed).tolist())
    print(f"\nlanguage ID changed {int(changed.sum())} labels: "
          + ", ".join(f"{a} -> {b}: {c}" for (a, b), c in moves.most_common()))
    flags = rule_clean_flags(labelled, params, syntax=syntax_result)
    code = flags["code"].sum()
    # A description by the stage's own rules; bench/labelled_code.py measures the verdicts.
    print("\nrule-clean share: " + ", ".join(f"{k} {flags[k].sum() / max(code, 1):.1%}"
                                            for k in ("parses", "not_generated", "not_source_mapped", "not_minified",
                                                      "not_encoded_data", "rule_clean"))
          + f" of {int(code)} code files ({int(code - flags['parse_checked'].sum())} never parsed)")
    print("\ndropped by the rules (first 40):")
    for i in np.flatnonzero(~rule_result.keep).tolist()[:40]:
        print(f"  {rule_result.reason[i]:<32} {batch.column('path')[i].as_py()}")


if __name__ == "__main__":
    main()
