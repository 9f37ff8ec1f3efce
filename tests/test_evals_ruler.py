"""RULER task generators and scoring, the evaluation data, and the statistics (no model, no compile)."""

import collections
import re

import numpy as np
import pytest

from certattn_jax.evals import data, ruler, stats


def words(s: ruler.Sample) -> int:
    """A cheap stand-in token counter (the real runs count SmolLM2 tokens of the chat prompt)."""
    return len((s.input + s.answer_prefix).split())


def test_scoring_matches_ruler_definitions():
    assert ruler.string_match_all("The numbers are 123 and 456.", ["123", "456", "789"]) == pytest.approx(2 / 3)
    assert ruler.string_match_all("ABC-def", ["abc-DEF"]) == 1.0  # case-insensitive
    assert ruler.string_match_part("only 456 here", ["123", "456"]) == 1.0
    assert ruler.string_match_part("nothing", ["123", "456"]) == 0.0
    assert ruler.postprocess("  a\x00b\n ") == "a\nb"
    with pytest.raises(ValueError, match="reference"):
        ruler.string_match_all("x", [])
    with pytest.raises(ValueError, match="unknown RULER task"):
        ruler.score("nope", "x", ["y"])


def test_books_are_prose_without_boilerplate():
    books = data.book_texts()
    assert len(books) == 4
    text = data.prose()
    assert "Frequency_lists" not in text and "def g():" not in text  # the trailing lists/code are gone
    assert "PROJECT GUTENBERG EBOOK" not in text
    assert books[0].count("Sherlock Holmes") > 10 and "Pierre" in books[3]
    with pytest.raises(ValueError, match="no Project Gutenberg book"):
        data.split_books("just some text\nwithout markers\n")
    assert data.split_books("x\n*** START OF A ***\nbody one\n*** END OF A ***\n") == ["body one"]


@pytest.mark.parametrize("task", sorted(ruler.TASKS))
def test_every_task_is_deterministic_fits_and_contains_its_answers(task):
    samples = ruler.generate_samples(task, 1500, 2, words, seed=3, max_new_tokens=16)
    again = ruler.generate_samples(task, 1500, 2, words, seed=3, max_new_tokens=16)
    assert [s.input for s in samples] == [s.input for s in again]
    assert samples[0].input != samples[1].input
    other = ruler.generate_samples(task, 1500, 1, words, seed=4, max_new_tokens=16)
    assert other[0].outputs != samples[0].outputs
    for s in samples:
        assert words(s) + 16 <= 1500
        assert s.outputs and all(o in s.input for o in s.outputs)
        assert ruler.score(task, " ".join(s.outputs), s.outputs) == 1.0
        assert ruler.score(task, "I do not know", s.outputs) == 0.0
    # fit_size returns the largest size that fits: one unit more does not
    size = ruler.fit_size(task, 1500, words, 0, 3, 16)
    assert words(ruler.make_sample(task, size, 1500, 0, 3, 16)) + 16 <= 1500
    assert words(ruler.make_sample(task, size + 1, 1500, 0, 3, 16)) + 16 > 1500


def test_task_structure_follows_ruler():
    s = ruler.make_sample("niah_multivalue", 400, 4096, 0)
    assert len(s.outputs) == 4 and s.input.startswith("Some special magic numbers are hidden")
    assert all(re.fullmatch(r"\d{7}", o) for o in s.outputs)
    single = ruler.make_sample("niah_single_3", 400, 4096, 0)
    assert single.input.startswith("A special magic uuid is hidden") and "is" in single.answer_prefix
    mq = ruler.make_sample("niah_multiquery", 400, 4096, 0)
    assert mq.answer_prefix.count(",") >= 2 and ", and " in mq.answer_prefix
    vt = ruler.make_sample("vt", 40, 4096, 0)
    chain = re.findall(r"VAR (\w+) = (?:VAR (\w+)|(\d+))", vt.input.split("Question:")[-2])
    assert len(vt.outputs) == 5 and vt.input.count("Question:") == 2  # one in-context example
    cwe = ruler.make_sample("cwe", 200, 4096, 0)
    listed = re.findall(r"\d+\. ([\w-]+)", cwe.input.split("Question:")[1])
    counts = collections.Counter(listed)
    assert all(counts[w] == 30 for w in cwe.outputs) and max(c for w, c in counts.items() if w not in cwe.outputs) == 3
    fwe = ruler.make_sample("fwe", 3000, 4096, 0)
    counts = collections.Counter(fwe.input.split("coded words. ")[1].split("\n")[0].split())
    top = [w for w, _ in counts.most_common(4)]
    assert top[0] == "..." and set(top[1:]) == set(fwe.outputs)
    assert chain


def test_needle_depth_is_respected():
    pos = []
    for d in (0, 50, 100):
        s = ruler.make_sample("niah_single_2", 2000, 4096, 0, depths=[d])
        pos.append(s.input.index("One of the special magic") / len(s.input))
    assert pos[0] < 0.05 and 0.4 < pos[1] < 0.6 and pos[2] > 0.9


def test_mcnemar_exact_and_perplexity():
    a = [True] * 5 + [False] * 0 + [True] * 10
    b = [False] * 5 + [True] * 10
    r = stats.mcnemar_exact(a, b)
    assert (r["a_only"], r["b_only"], r["discordant"]) == (5, 0, 5)
    assert r["p_value"] == pytest.approx(2 * 0.5 ** 5)
    assert stats.mcnemar_exact([True, False], [True, False])["p_value"] == 1.0
    with pytest.raises(ValueError, match="equal lengths"):
        stats.mcnemar_exact([True], [True, False])
    assert stats.perplexity(3 * 2.0, 3) == pytest.approx(7.389056, rel=1e-6)


def test_paired_ppl_delta_matches_the_ppl_ratio_and_its_interval_covers_the_truth():
    rng = np.random.default_rng(7)
    base = [rng.gamma(2.0, 1.5, size=300) for _ in range(6)]
    # a true per-token shift of 0.01 nats plus noise: delta = 100 (e^0.01 - 1) = 1.005 %
    other = [b + 0.01 + rng.normal(0.0, 0.05, size=b.size) for b in base]
    r = stats.paired_ppl_delta(other, base)
    ppl_a = stats.perplexity(float(np.concatenate(other).sum()), 1800)
    ppl_b = stats.perplexity(float(np.concatenate(base).sum()), 1800)
    assert r["delta_percent"] == pytest.approx(100 * (ppl_a / ppl_b - 1), rel=1e-9)
    lo, hi = r["ci95_percent"]
    assert lo < 1.005 < hi and hi - lo < 1.0
    assert r["tokens"] == 1800 and r["windows"] == 6 and len(r["per_window_delta_percent"]) == 6
    # a window-level effect (correlated tokens) widens the interval beyond the token-level one
    shifted = [b + rng.normal(0.0, 0.05) for b in base]
    r2 = stats.paired_ppl_delta(shifted, base)
    assert r2["se_window_nats"] > 3 * r2["se_token_nats"]
    with pytest.raises(ValueError):
        stats.paired_ppl_delta([], [])
