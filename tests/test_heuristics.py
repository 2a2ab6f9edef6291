"""The tier-1 heuristic filters, rule by rule, on small crafted documents."""

from __future__ import annotations

import dataclasses

import numpy as np
import pyarrow as pa
import pytest

from assay.config import (
    C4Params,
    FineWebQualityParams,
    GopherQualityParams,
    GopherRepetitionParams,
    HeuristicsParams,
    params_from_dict,
)
from assay.errors import AssayError
from filters.c4 import C4Filter
from filters.fineweb import FineWebQualityFilter
from filters.gopher import GopherQualityFilter, GopherRepetitionFilter
from filters.heuristics import apply_by_source, apply_chain, build_heuristics, check_source_rules
from filters.text_units import WordSplitter, batch_text, sentence_counts, split_words

# --- documents -------------------------------------------------------------------

#: Ordinary English prose that passes every rule with the default settings.
GOOD = (
    "The history of the printing press is closely tied to the spread of literacy in Europe.\n"
    "Before movable type, books had to be copied by hand, which made them rare and expensive.\n"
    "Johannes Gutenberg combined several existing technologies with new ideas of his own.\n"
    "His press could produce thousands of pages a day, and the cost of books fell quickly.\n"
    "Within fifty years, printers were working in more than two hundred cities across the continent.\n"
    "Historians still debate how much of the change that followed should be credited to the press."
)

WORDS = (
    "river mountain forest valley meadow harbor island desert canyon glacier prairie lagoon orchard "
    "village castle bridge tunnel market temple garden library museum theater stadium airport station "
    "factory quarry vineyard cottage palace fortress lighthouse monastery cathedral courtyard pavilion "
    "observatory greenhouse warehouse workshop bakery brewery tavern chapel citadel rampart aqueduct "
    "causeway boulevard avenue terrace balcony corridor staircase cellar attic chimney fountain statue"
).split()


def prose(n_words: int, stop: bool = True, per_line: int = 12, end: str = ".") -> str:
    """`n_words` distinct-ish words in lines of `per_line`, each line ending with `end`."""
    words = []
    for i in range(n_words):
        word = WORDS[i % len(WORDS)] + ("" if i < len(WORDS) else str(i // len(WORDS)))
        words.append(("the" if i % 5 == 0 else "and" if i % 7 == 0 else word) if stop else word)
    lines = [" ".join(words[i:i + per_line]) + end for i in range(0, n_words, per_line)]
    return "\n".join(lines)


def batch(*texts: str, kinds: list[str] | None = None) -> pa.RecordBatch:
    return pa.record_batch({
        "id": pa.array([f"d{i}" for i in range(len(texts))]),
        "text": pa.array(list(texts), pa.large_string()),
        "kind": pa.array(kinds or ["text"] * len(texts)),
    })


def verdict(filt, text: str) -> str | None:
    result = filt.apply(batch(text))
    assert len(result.keep) == 1 and len(result.reason) == 1
    assert result.keep[0] == (result.reason[0] is None)
    for values in result.scores.values():
        assert values.dtype == np.float64 and values.shape == (1,)
    return result.reason[0]


# --- words -------------------------------------------------------------------------


@pytest.mark.parametrize("text, words", [
    ("Don't stop (e.g. now).", ["Do", "n't", "stop", "(", "e.g.", "now", ")", "."]),
    ("Visit https://example.com/a?b=1, or os.path.join(a, b):",
     ["Visit", "https://example.com/a?b=1", ",", "or", "os.path.join(a", ",", "b", "):"]),
    ("It costs $5.00 -- 10km/h; U.S.A. rocks!!",
     ["It", "costs", "$", "5.00", "--", "10", "km/h", ";", "U.S.A.", "rocks", "!", "!"]),
    ("self.foo(bar):) x  y", ["self.foo(bar", "):", ")", "x", "y"]),
    ("\"Hello,\" she said... 'quoted' text\u2014dash",
     ['"', "Hello", ",", '"', "she", "said", "...", "'", "quoted", "'", "text", "\u2014", "dash"]),
    ("--help -f [OPTION]... FILE", ["--help", "-f", "[", "OPTION", "]", "...", "FILE"]),
])
def test_words_follow_spacy_english(text, words):
    assert split_words(text) == words


def test_long_chunks_split_in_linear_time():
    import time

    start = time.perf_counter()
    assert len(split_words("(" * 300_000)) == 300_000  # every "(" is a prefix
    assert len(split_words("a:" * 200_000)) == 400_000  # ":" between letters is an infix, the last one a suffix
    assert len(split_words("x" * 1_000_000 + ".")) == 2
    assert time.perf_counter() - start < 20  # seconds; quadratic peeling took minutes


def test_word_splitter_matches_split_words_and_caches():
    splitter = WordSplitter()
    texts = pa.array(["Don't stop.", "", None, "a  b\tc", "Don't stop."], pa.large_string())
    tokens = splitter.split(texts)
    assert tokens.counts.tolist() == [4, 0, 0, 3, 4]
    vocab = {v: k for k, v in tokens.vocab.tokens.items()}
    assert [vocab[i] for i in tokens.ids[:4]] == ["Do", "n't", "stop", "."]
    assert tokens.length.tolist() == [len(vocab[i]) for i in tokens.ids]
    again = splitter.split(pa.array(["stop."]))
    assert again.vocab is tokens.vocab and again.ids.tolist() == tokens.ids[2:4].tolist()
    splitter.clear()
    assert splitter.split(pa.array(["stop."])).vocab is not tokens.vocab


def test_sentences_are_counted_like_spacys_sentencizer():
    tokens = WordSplitter().split(pa.array(["One. Two! Three?", "No end", ". Hello", "Wait... what?! Yes.", ""]))
    assert sentence_counts(tokens).tolist() == [3, 1, 2, 2, 1]  # "..." is not a terminal


def test_units_are_shared_between_filters_of_one_batch():
    b = batch(GOOD)
    assert batch_text(b) is batch_text(b)
    assert batch_text(b) is not batch_text(batch(GOOD))


# --- Gopher quality ---------------------------------------------------------------


def test_gopher_quality_keeps_prose():
    result = GopherQualityFilter(GopherQualityParams()).apply(batch(GOOD, prose(80)))
    assert result.keep.tolist() == [True, True]
    assert result.reason == [None, None]
    assert result.scores["gopher_quality:word_count"][0] == len(GOOD.split())
    assert result.scores["gopher_quality:stop_words"][0] >= 2


@pytest.mark.parametrize("text, rule", [
    (prose(30), "word_count"),
    (" ".join(["ab", "cd", "the", "and", "be"] * 20), "mean_word_length"),
    (" ".join(["Incomprehensibilities", "the", "counterrevolutionaries", "and", "Uncharacteristically"] * 20),
     "mean_word_length"),
    (prose(80) + "\n" + " ".join(["#tag"] * 12), "hash_word_ratio"),
    (prose(80) + "\n" + "and so on ... " * 20, "ellipsis_word_ratio"),
    ("\n".join("- " + line for line in prose(120).splitlines()), "bullet_lines_frac"),
    ("\n".join(line + " and more ..." for line in prose(120, per_line=20).splitlines()), "ellipsis_lines_frac"),
    (prose(60) + "\n" + " ".join(str(1000 + i) for i in range(40)), "alpha_words_frac"),
    (prose(80, stop=False), "stop_words"),
])
def test_gopher_quality_rules(text, rule):
    assert verdict(GopherQualityFilter(GopherQualityParams()), text) == f"gopher_quality:{rule}"


def test_gopher_quality_too_many_words_and_disabled_rules():
    params = GopherQualityParams(max_doc_words=60)
    assert verdict(GopherQualityFilter(params), prose(80)) == "gopher_quality:word_count"
    text = prose(80, stop=False)
    params = dataclasses.replace(GopherQualityParams(), min_stop_words=None)
    assert verdict(GopherQualityFilter(params), text) is None


def test_gopher_quality_counts_symbol_only_words_separately_in_datatrove_mode():
    result = GopherQualityFilter(words="datatrove").apply(batch(prose(60) + " ... -- ! ?"))
    scores = {k.split(":")[1]: v[0] for k, v in result.scores.items()}
    assert scores["word_count"] == 60  # line-final "." tokens and "...", "--", "!", "?" are not words
    assert scores["alpha_words_frac"] < 1.0


def test_gopher_quality_counts_whitespace_words_by_default():
    text = prose(60) + " ... -- ! ?"
    result = GopherQualityFilter().apply(batch(text))
    scores = {k.split(":")[1]: v[0] for k, v in result.scores.items()}
    assert scores["word_count"] == len(text.split()) == 64  # the paper's words: "... -- ! ?" are 4 of them
    assert scores["alpha_words_frac"] == pytest.approx(60 / 64)
    assert scores["mean_word_length"] == pytest.approx(sum(map(len, text.split())) / 64)


#: A real paragraph of prose: /usr/share/doc/base-files/README (Debian), GPL.
README_PARAGRAPH = """A. I delegate such decisions to the policy group. If you want to
propose a new license you should make a policy proposal to modify the
paragraph in policy saying "Packages distributed under the Apache
license (version 2.0), the Artistic license, the GNU GPL (versions 1,
2, or 3), the GNU LGPL (versions 2, 2.1, or 3), and the GNU FDL
(versions 1.2 or 1.3) should refer to the corresponding files under
/usr/share/common-licenses". The way of doing this is explained in the
debian-policy package. As usual, you should always take a look at
already reported bugs against debian-policy before submitting a new
one."""


def test_real_readme_prose_is_kept_under_the_papers_word_count():
    """Punctuation is not a word (Rae et al. 2021): this README paragraph has 91% words with a letter."""
    paper = GopherQualityFilter(words="paper").apply(batch(README_PARAGRAPH))
    assert paper.reason == [None]
    assert paper.scores["gopher_quality:alpha_words_frac"][0] == pytest.approx(
        sum(any(c.isalpha() for c in w) for w in README_PARAGRAPH.split()) / len(README_PARAGRAPH.split()))
    # datatrove's spaCy tokens make every "(", ",", "." a word without a letter: 73% < 80%.
    datatrove = GopherQualityFilter(words="datatrove").apply(batch(README_PARAGRAPH))
    assert datatrove.reason == ["gopher_quality:alpha_words_frac"]
    assert datatrove.scores["gopher_quality:alpha_words_frac"][0] < 0.8
    # The default chain follows the paper.
    assert build_heuristics(HeuristicsParams())[1].words == "paper"
    assert HeuristicsParams().words == "paper"


def test_repetition_ngrams_follow_the_word_definition():
    # ", and the" repeats as spaCy tokens, not as whitespace words ("x, and the" differs per x).
    text = " ".join(f"{w}, and the {w}s." for w in WORDS[:40])
    paper = GopherRepetitionFilter(words="paper").apply(batch(text))
    datatrove = GopherRepetitionFilter(words="datatrove").apply(batch(text))
    assert (paper.scores["gopher_repetition:top_3_gram_char_frac"][0]
            < datatrove.scores["gopher_repetition:top_3_gram_char_frac"][0])


def test_an_unknown_word_definition_is_an_error():
    with pytest.raises(ValueError, match="words must be"):
        GopherQualityFilter(words="spacy")
    with pytest.raises(AssayError, match="static.heuristics.words"):
        params_from_dict({"static": {"heuristics": {"words": "spacy"}}})


# --- Gopher repetition ------------------------------------------------------------


def test_gopher_repetition_keeps_prose():
    result = GopherRepetitionFilter(GopherRepetitionParams()).apply(batch(GOOD))
    assert result.reason == [None]
    assert set(result.scores) >= {"gopher_repetition:dup_line_frac", "gopher_repetition:top_2_gram_char_frac",
                                  "gopher_repetition:dup_10_gram_char_frac"}


def test_gopher_repetition_rules():
    f = GopherRepetitionFilter(GopherRepetitionParams())
    assert verdict(f, "") == "gopher_repetition:empty"
    paragraphs = [f"Paragraph {i} has its own words, number {i * 7}." for i in range(6)]
    assert verdict(f, "\n\n".join(paragraphs + paragraphs[:4])) == "gopher_repetition:dup_para_frac"
    long_para = ("A long paragraph that is repeated only once but is much longer than the others. " * 3).strip()
    text = "\n\n".join([long_para, "Short one.", "Another short one.", "Third.", "Fourth.", long_para])
    assert verdict(f, text) == "gopher_repetition:dup_para_char_frac"
    lines = [f"Line number {i} says something different from {i + 1}." for i in range(6)]
    assert verdict(f, "\n".join(lines + lines[:4])) == "gopher_repetition:dup_line_frac"
    long_line = "This line is long and repeated once, which is enough to matter here."
    text = "\n".join([long_line, "one", "two", "three", "four", "five", long_line])
    assert verdict(f, text) == "gopher_repetition:dup_line_char_frac"
    assert verdict(f, " ".join(["buy now"] * 30) + " " + prose(30)) == "gopher_repetition:top_2_gram_char_frac"


def _datatrove_dup_chars(words: list[str], n: int) -> int:
    """datatrove's definition, written plainly: the reference for the vectorised version."""
    seen, idx, total = set(), 0, 0
    while idx < len(words) - n + 1:
        gram = tuple(words[idx:idx + n])
        if gram in seen:
            total += sum(map(len, gram))
            idx += n
        else:
            seen.add(gram)
            idx += 1
    return total


def test_gopher_repetition_duplicated_ngrams():
    phrase = "the quick brown fox jumps over the lazy dog near the river bank"
    a, b, c = (" ".join(WORDS[i:j]) for i, j in ((0, 20), (20, 40), (40, 55)))
    texts = [
        f"{a} {phrase} {b} {phrase} {c}",
        f"{a} {phrase} {phrase} {phrase} {b}",  # overlapping repeats: the scan has to jump
        " ".join(["x y z"] * 30),
        " ".join(f"w{i % 17} w{i % 5}" for i in range(200)),
        "few words",
    ]
    no_top = GopherRepetitionParams(top_n_grams={})
    result = GopherRepetitionFilter(no_top).apply(batch(*texts))
    for n in range(5, 11):
        expected = [_datatrove_dup_chars(split_words(t), n) / len(t) for t in texts]
        assert result.scores[f"gopher_repetition:dup_{n}_gram_char_frac"].tolist() == pytest.approx(expected), n
    assert result.reason[1] == "gopher_repetition:dup_5_gram_char_frac"
    lenient = GopherRepetitionParams(top_n_grams={}, dup_n_grams={n: 0.5 for n in range(5, 11)})
    assert verdict(GopherRepetitionFilter(lenient), texts[1]) is None


def test_gopher_repetition_top_ngram_ties_go_to_the_first():
    text = "a b c d a b c d e f"  # "a b" and "b c" both occur twice: "a b" comes first
    result = GopherRepetitionFilter().apply(batch(text))
    assert result.scores["gopher_repetition:top_2_gram_char_frac"][0] == pytest.approx(2 * 3 / len(text))
    once = "every word here is different"
    result = GopherRepetitionFilter().apply(batch(once))  # no repeats: the first n-gram, counted once
    expected = len("every word here") / len(once)
    assert result.scores["gopher_repetition:top_3_gram_char_frac"][0] == pytest.approx(expected)


# --- C4 ---------------------------------------------------------------------------


def test_c4_keeps_prose_and_reports_removed_lines():
    text = GOOD + "\nShort line\nThis site uses cookies to improve things.\nEnable JavaScript to see this page."
    result = C4Filter(C4Params()).apply(batch(text))
    assert result.reason == [None]
    assert result.scores["c4:sentences"][0] == 6
    assert result.scores["c4:lines_removed_frac"][0] == pytest.approx(3 / 9)
    assert batch(text).column("text")[0].as_py() == text  # nothing is rewritten


@pytest.mark.parametrize("text, reason", [
    ("One sentence here. Two sentences here.\nThree is here too.", "too_few_sentences"),
    (GOOD + "\nLorem ipsum dolor sit amet.", "lorem_ipsum"),
    (GOOD + "\nint main() { return 0; }", "curly_bracket"),
    # Removed lines no longer count: javascript, cookie notices, too few words, a huge word.
    ("\n".join(GOOD.splitlines()[:4]) + "\nPlease enable javascript in your browser now.", "too_few_sentences"),
    ("\n".join(GOOD.splitlines()[:4]) + "\nRead our privacy policy for the details.", "too_few_sentences"),
    ("\n".join(GOOD.splitlines()[:4]) + "\nToo short.", "too_few_sentences"),
    ("\n".join(GOOD.splitlines()[:4]) + "\nA word " + "x" * 1001 + " is long.", "too_few_sentences"),
    # The first fatal line wins.
    (GOOD + "\nint x = f() { 1 };\nLorem ipsum dolor sit amet.", "curly_bracket"),
    (GOOD + "\nLorem ipsum dolor sit amet.\nint x = f() { 1 };", "lorem_ipsum"),
])
def test_c4_rules(text, reason):
    assert verdict(C4Filter(C4Params()), text) == f"c4:{reason}"


def test_c4_fatal_rules_only_look_at_surviving_lines():
    f = C4Filter(C4Params())
    assert verdict(f, GOOD + "\n{\n}\nlorem ipsum") is None  # too few words: removed before the checks
    assert verdict(f, GOOD + "\nvar x = { javascript: true };") is None  # removed for javascript first
    assert verdict(f, GOOD + "\nSee the notes [1] for more, and the lorem ipsum text.") == "c4:lorem_ipsum"


def test_c4_settings():
    no_punct = GOOD.replace(".", "")
    assert verdict(C4Filter(C4Params()), no_punct) is None
    assert verdict(C4Filter(C4Params(filter_no_terminal_punct=True)), no_punct) == "c4:too_few_sentences"
    assert verdict(C4Filter(C4Params(filter_curly_bracket=False)), GOOD + "\nint main() { return 0; }") is None
    assert verdict(C4Filter(C4Params(filter_lorem_ipsum=False)), GOOD + "\nLorem ipsum dolor sit amet.") is None
    assert verdict(C4Filter(C4Params(min_num_sentences=-1)), "Hi there you.") is None
    js = "\n".join(GOOD.splitlines()[:4]) + "\nPlease enable javascript in your browser now."
    assert verdict(C4Filter(C4Params(filter_javascript=False)), js) is None


# --- FineWeb quality ----------------------------------------------------------------


def test_fineweb_quality_keeps_prose():
    assert verdict(FineWebQualityFilter(FineWebQualityParams()), GOOD) is None


@pytest.mark.parametrize("text, rule", [
    ("\n \n\t\n", "empty"),
    ("\n".join(f"A heading without any final mark number {i}" for i in range(20)), "line_punct_ratio"),
    ("\n".join(f"Item {i} is short." for i in range(20)) + "\n" + GOOD, "short_line_ratio"),
    (GOOD + "\n" + GOOD.splitlines()[0], "char_dup_ratio"),
    ("\n".join(f"{WORDS[i]}{WORDS[i + 1]}{WORDS[i + 2]} {WORDS[i + 3]}{WORDS[i + 4]}." for i in range(40)),
     "list_ratio"),
])
def test_fineweb_quality_rules(text, rule):
    assert verdict(FineWebQualityFilter(FineWebQualityParams()), text) == f"fineweb_quality:{rule}"


def test_fineweb_quality_settings():
    lines = "\n".join(f"A heading without any final mark number {i}" for i in range(20))
    assert verdict(FineWebQualityFilter(FineWebQualityParams(line_punct_thr=0.0)), lines) is None


# --- the chain ------------------------------------------------------------------------


def test_build_heuristics_order_and_disabled_filters():
    assert [f.name for f in build_heuristics(HeuristicsParams())] == [
        "gopher_repetition", "gopher_quality", "records", "c4", "fineweb_quality"]
    params = HeuristicsParams()
    params.gopher_quality.enabled = False
    params.records.enabled = False
    params.c4.enabled = False
    filters = build_heuristics(params)
    assert [f.name for f in filters] == ["gopher_repetition", "fineweb_quality"]
    assert filters[0].params is params.gopher_repetition
    for section in ("gopher_repetition", "fineweb_quality"):
        getattr(params, section).enabled = False
    assert build_heuristics(params) == []
    result = apply_chain([], batch(""))
    assert result.keep.tolist() == [True] and result.reason == [None]


def test_chain_cascades_and_leaves_other_kinds_alone():
    code = "def f(x):\n    return {x: x}\n" * 3
    texts = [GOOD + "\n" + GOOD.splitlines()[0], code, "", GOOD, prose(30)]
    b = batch(*texts, kinds=["text", "code", "text", "text", "text"])
    result = apply_chain(build_heuristics(), b)
    assert result.keep.tolist() == [False, True, False, True, False]
    assert result.reason == [
        "fineweb_quality:char_dup_ratio",  # passes the first three filters
        None,  # code is not judged
        "gopher_repetition:empty",  # first filter in the chain
        None,
        "gopher_quality:word_count",
    ]
    assert "gopher_repetition:dup_line_frac" in result.scores and "c4:sentences" in result.scores
    for key, values in result.scores.items():
        assert len(values) == 5 and np.isnan(values[1]), key  # no scores for code
    # Every filter scored every text row, also rows an earlier filter dropped.
    assert not np.isnan(result.scores["fineweb_quality:list_ratio"][4])


def test_chain_on_code_only_and_all_filters_disabled():
    code_only = batch("x = 1", "y = 2", kinds=["code", "code"])
    result = apply_chain(build_heuristics(), code_only)
    assert result.keep.tolist() == [True, True] and result.reason == [None, None] and result.scores == {}
    params = HeuristicsParams()
    for section in ("gopher_quality", "gopher_repetition", "c4", "fineweb_quality"):
        getattr(params, section).enabled = False
    result = apply_chain(build_heuristics(params), batch("", "x"))
    assert result.keep.tolist() == [True, True] and result.reason == [None, None]


def test_empty_batches_and_blank_texts():
    empty = batch()
    for filt in build_heuristics():
        result = filt.apply(empty)
        assert len(result.keep) == 0 and result.reason == []
    result = apply_chain(build_heuristics(), empty)
    assert len(result.keep) == 0 and result.reason == [] and result.scores == {}
    result = apply_chain(build_heuristics(), batch("", " ", "\n\n"))
    assert result.reason == ["gopher_repetition:empty", "gopher_quality:word_count", "gopher_repetition:dup_line_frac"]


def test_a_table_with_several_chunks_is_accepted():
    table = pa.concat_tables([pa.Table.from_batches([batch(GOOD)]), pa.Table.from_batches([batch(prose(30))])])
    result = apply_chain(build_heuristics(), table)
    assert result.reason == [None, "gopher_quality:word_count"]


# --- switches -----------------------------------------------------------------------------


def test_null_turns_a_single_rule_off_from_params():
    """`null` in params.yaml turns one rule off (the docs' promise), for every filter."""
    on = params_from_dict({}).static.heuristics
    off = params_from_dict({"static": {"heuristics": {
        "gopher_quality": {"min_alpha_words_ratio": None, "min_stop_words": None},
        "gopher_repetition": {"dup_line_frac": None, "top_n_grams": {2: None, 3: 0.18, 4: 0.16}},
        "c4": {"min_num_sentences": None, "min_words_per_line": None, "max_word_length": None},
        "fineweb_quality": {"line_punct_thr": None, "short_line_thr": None, "new_line_ratio": None},
    }}}).static.heuristics
    assert off.gopher_quality.min_alpha_words_ratio is None and off.gopher_repetition.top_n_grams[2] is None
    numbers = prose(60) + "\n" + " ".join(str(1000 + i) for i in range(40))
    assert verdict(GopherQualityFilter(on.gopher_quality), numbers) == "gopher_quality:alpha_words_frac"
    assert verdict(GopherQualityFilter(off.gopher_quality), numbers) is None
    assert verdict(GopherQualityFilter(off.gopher_quality), prose(80, stop=False)) is None
    lines = "\n".join(["the same line repeats and repeats here"] * 5 + [prose(60)])
    assert verdict(GopherRepetitionFilter(on.gopher_repetition), lines) == "gopher_repetition:dup_line_frac"
    assert verdict(GopherRepetitionFilter(off.gopher_repetition), lines) != "gopher_repetition:dup_line_frac"
    pairs = " ".join(["hello world"] * 60)
    assert verdict(GopherRepetitionFilter(on.gopher_repetition), pairs).startswith("gopher_repetition:")
    off_pairs = dataclasses.replace(off.gopher_repetition, dup_line_frac=0.3, top_n_grams={2: None},
                                    dup_n_grams={})
    assert verdict(GopherRepetitionFilter(off_pairs), pairs) is None
    short = "One short line here.\nAnother one."
    assert verdict(C4Filter(on.c4), short) == "c4:too_few_sentences"
    assert verdict(C4Filter(off.c4), short) is None
    listing = "\n".join(f"item {i}" for i in range(40))
    assert verdict(FineWebQualityFilter(on.fineweb_quality), listing) == "fineweb_quality:line_punct_ratio"
    assert verdict(FineWebQualityFilter(off.fineweb_quality), listing) is None


def test_source_rules_choose_filters_per_source_and_never_none():
    filters = build_heuristics()
    code = "def f(x):\n    return {x: x}\n" * 3
    text_with_brace = GOOD + "\nUse {braces} sparingly, as the style guide of the project says."
    b = pa.record_batch({
        "id": pa.array(["a", "b", "c"]),
        "text": pa.array([text_with_brace, text_with_brace, code], pa.large_string()),
        "kind": pa.array(["text", "text", "code"]),
        "source": pa.array(["web", "docs", "docs"]),
    })
    result = apply_by_source(filters, b, {"docs": ["gopher_repetition", "gopher_quality"]})
    assert result.reason == ["c4:curly_bracket", None, None]  # the docs source is judged by Gopher only
    assert np.isnan(result.scores["c4:sentences"][1]) and not np.isnan(result.scores["c4:sentences"][0])
    assert not np.isnan(result.scores["gopher_quality:word_count"][1])
    assert apply_by_source(filters, b, {}).reason == apply_chain(filters, b).reason
    with pytest.raises(ValueError, match="no enabled heuristic filter"):
        check_source_rules([f for f in filters if f.name != "c4"], {"docs": ["c4"]})
    with pytest.raises(ValueError, match="unknown filter"):
        check_source_rules(filters, {"docs": ["gopher"]})
    with pytest.raises(AssayError, match="at least one heuristic filter"):
        params_from_dict({"static": {"source_rules": {"docs": []}}})
    with pytest.raises(AssayError, match="unknown filter"):
        params_from_dict({"static": {"source_rules": {"docs": ["c5"]}}})


# --- hard-wrapped paragraphs (ours: C4's and FineWeb's line rules assume web text's one line per paragraph) ---

#: /usr/share/doc/tar/README.Debian (Debian's tar 1.34), verbatim: plain prose hard-wrapped at ~80 columns.
TAR_README_DEBIAN = (
    "The options -Z, --compress, and --uncompress all require that there be a\n"
    "'compress' utility installed on the system.  If there is no compress installed\n"
    "on your system, you will get errors if you try to use these options to tar.  \n"
    "\n"
    "While the algorithm used by compress was originally encumbered by patents, \n"
    "enough time has passed that 'ncompress' is now available in Debian main.\n"
    "\n"
    "- - - - -\n"
    "\n"
    "The tar upstream developers prefer to document using the 'info' format, but \n"
    "unfortunately the info docs are under a license Debian considers non-free.  If\n"
    "you want the full, canonical documentation for tar and not just the man page\n"
    "that upstream provides as a courtesy to users, you might want to install the\n"
    "tar-doc package which can be found in Debian non-free.  Alternatively, you\n"
    "can find the tar doc online at https://www.gnu.org/software/tar/manual/\n"
)


def test_a_real_hard_wrapped_readme_is_kept_once_its_paragraphs_are_reflowed():
    """The published line rules drop it (most lines end mid-sentence); judged per paragraph, it passes."""
    published = HeuristicsParams(reflow=dataclasses.replace(HeuristicsParams().reflow, enabled=False))
    old = apply_chain(build_heuristics(published), batch(TAR_README_DEBIAN))
    assert old.reason == ["fineweb_quality:line_punct_ratio"]
    new = apply_chain(build_heuristics(HeuristicsParams()), batch(TAR_README_DEBIAN))
    assert new.keep.tolist() == [True], new.reason
    assert new.scores["fineweb_quality:line_punct_ratio"][0] > 0.12 > old.scores["fineweb_quality:line_punct_ratio"][0]


def test_reflow_joins_only_the_soft_breaks_of_wrapped_paragraphs():
    import textwrap

    from filters.text_units import reflow_hard_wrapped

    sentence = ("this library reads and writes configuration files in a small format and is used by several "
                "other programs on the system without any dependency beyond the standard library")
    wrapped = textwrap.fill(sentence[0].upper() + sentence[1:] + ".", 72)
    assert wrapped.count("\n") >= 2
    texts = [
        wrapped + "\n\nUsage\n=====\n\n" + wrapped.replace("\n", "\r\n") + "\n- first item\n- second item\n",
        "Home\nAbout us\nContact\nNews and events\n",                     # a menu: short lines stay lines
        "pkg/module.py,sha256=abcdefghijklmnopqrstuvwxyz0123456789ABCDEFG,1234\n" * 4,  # one word per line
        ("A web page puts a whole paragraph on one line, " * 4).strip() + "\n" + wrapped,  # widest line > 100
        "One sentence per line, all of them about the same length here.\n"
        "Another sentence on its own line, ending where it should end.\n",
        "",
    ]
    out = reflow_hard_wrapped(pa.array(texts, pa.large_string()), 50, 100).to_pylist()
    assert [len(t.encode()) for t in out] == [len(t.encode()) for t in texts]  # bytes replaced in place
    first = out[0].split("\n\n")
    assert first[0] == wrapped.replace("\n", " ")
    assert first[1] == "Usage\n=====" and "\n" not in first[2].split("\n- ")[0].replace("\r", "")
    assert first[2].endswith("standard library.\n- first item\n- second item\n")
    assert out[1:] == texts[1:]
    # A sliced (offset) array is handled, and string (32-bit offsets) too.
    sliced = reflow_hard_wrapped(pa.array(["x", wrapped], pa.string()).slice(1), 50, 100).to_pylist()
    assert sliced == [wrapped.replace("\n", " ")]


def test_reflow_is_a_setting_and_off_gives_the_published_rules():
    off = params_from_dict({"static": {"heuristics": {"reflow": {"enabled": False}}}}).static.heuristics
    assert all(getattr(f, "reflow", None) is None for f in build_heuristics(off))
    on = build_heuristics(HeuristicsParams())
    assert {f.name: getattr(f, "reflow", None) for f in on}["c4"] == (50, 100)
    with pytest.raises(AssayError, match="min_width"):
        params_from_dict({"static": {"heuristics": {"reflow": {"min_width": 120, "max_width": 100}}}})


def test_source_rules_accept_patterns_and_the_defaults_judge_plain_text_files_by_gopher():
    from filters.heuristics import rules_for

    rules = {"doc-readme": ["c4"], "doc-*": ["gopher_quality"], "*": ["fineweb_quality"]}
    assert rules_for("doc-readme", rules) == ["c4"]  # an exact name wins over patterns
    assert rules_for("doc-news", rules) == ["gopher_quality"]  # then the first pattern that matches
    assert rules_for("man", rules) == ["fineweb_quality"] and rules_for("man", {"doc-*": ["c4"]}) is None
    defaults = params_from_dict({}).static
    gopher = ["gopher_repetition", "gopher_quality", "records"]
    for source in ("doc-readme", "pypi-description", "pypi-record", "dpkg-manifest", "debian-changelog", "logs",
                   "fresh-licence", "fresh2-vim-help", "fresh3-perl-pod", "fresh4-rust-book"):
        assert rules_for(source, defaults.source_rules) == gopher, source
    assert rules_for("man", defaults.source_rules) is None  # anything else: the whole chain
    b = pa.record_batch({
        "text": pa.array([TAR_README_DEBIAN + "\nUse the {braces} as shown."] * 2, pa.large_string()),
        "kind": pa.array(["text", "text"]),
        "source": pa.array(["doc-readme", "web"]),
    })
    result = apply_by_source(build_heuristics(defaults.heuristics), b, defaults.source_rules)
    assert result.reason == [None, "c4:curly_bracket"]


def test_reflowed_text_splits_alike_on_every_thread():
    """Reflowing copies the text into a buffer Arrow allocates (padded). It was a bare numpy copy, and
    Arrow's whitespace split, which may read past the last string, then split the batch's last text by
    whatever memory followed: under two threads the word counts of FineWeb's `list_ratio` changed from
    run to run (a crash-resume test caught one document)."""
    import threading

    from filters.text_units import BatchText

    paragraph = ("The quick brown fox jumps over the lazy dog near the river bank while the\n"
                 "farmer watches from the old wooden fence and counts his sheep again.\n")
    batches = [pa.array([paragraph * (3 + (k + j) % 5) + f"       2001 Someone\n\n14 November 2005    UPDATE-RC.D({k})\n"
                         for j in range(6)], pa.large_string()) for k in range(6)]

    def counts(texts: pa.Array) -> list[int]:
        words = BatchText(texts).plain().reflowed(60, 100).words
        return np.diff(words.offsets).tolist()

    expected = [counts(b) for b in batches]
    for _ in range(30):
        got: list = [None] * len(batches)

        def work(part: list[int]) -> None:
            for i in part:
                got[i] = counts(batches[i])

        threads = [threading.Thread(target=work, args=(list(range(j, len(batches), 2)),)) for j in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert got == expected
