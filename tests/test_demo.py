"""The demo's needle prompts, its found/missed and agreement logic, and (slow) that SmolLM2 retrieves the
demo's default needle with the dense cache."""

import pytest

from certattn_jax import cli
from certattn_jax.demo import DEMO_DEPTH, DEMO_FORMAT, DEMO_SEED, ModeResult, agreement, conclusion, verdicts
from certattn_jax.needle import FORMATS, build_needle_prompt, contains_needle


class _WordTokenizer:
    """One token per whitespace-separated word; a chat template that wraps the user message."""

    chat_template = "fake"

    def encode(self, text: str) -> list[int]:
        return [len(w) for w in text.split()]

    def apply_chat_template(self, messages, add_generation_prompt=True):
        return f"<user> {messages[0]['content']} <assistant> "


def _result(mode, text, tokens):
    return ModeResult(mode, text, tokens, compile_s=1.0, prefill_s=2.0, decode_s=0.5, wall_s=4.0, tokens_per_s=9.0)


def test_found_missed_and_agreement_with_fake_outputs():
    dense = _result("dense", " 7341826.", [1, 2, 3])
    naive = _result("naive", " 7341862.", [1, 2, 4])
    cert = _result("certified", " 7341826.", [1, 2, 3])
    rows = verdicts([dense, naive, cert], "7341826", dense)
    assert [(r["mode"], r["found"], r["vs_dense"]) for r in rows] == [
        ("dense", True, "(reference)"), ("naive", False, "differs from token 2"), ("certified", True, "identical")]
    assert conclusion(rows) == "Dense found the needle; naive missed it, certified found it."
    assert conclusion(verdicts([dense, cert, cert], "7341826", dense)) == "Every cache found the needle."
    # all three agree on a wrong answer: the conclusion must say that the reference missed
    wrong = [_result(m, "The password is 1234567890.", [5, 6]) for m in cli.CACHE_MODES]
    rows = verdicts(wrong, "violet-otter-15", wrong[0])
    assert [r["vs_dense"] for r in rows[1:]] == ["identical", "identical"]
    assert not any(r["found"] for r in rows)
    assert "DENSE cache MISSED" in conclusion(rows)
    assert agreement([1, 2], [1, 2, 3]) == "differs from token 2"
    assert contains_needle("Amber-Otter-31", "amber-otter-31") and not contains_needle("7,341,826", "7341826")


def test_needle_prompt_is_reproducible_and_primed():
    tok = _WordTokenizer()
    p = build_needle_prompt(tok, "magic-prose-primed", 300, seed=3)
    assert p == build_needle_prompt(tok, "magic-prose-primed", 300, seed=3)  # reproducible from the seed
    assert 300 <= p.doc_tokens < 330 and len(p.ids) > p.doc_tokens
    assert len(p.value) == 7 and p.value.isdigit()
    prime = tok.encode(FORMATS["magic-prose-primed"].prime.format(key=p.key, value=p.value))
    assert p.ids[-len(prime):] == prime
    other = build_needle_prompt(tok, "magic-prose-primed", 300, seed=4)
    assert (other.key, other.value) != (p.key, p.value)


def test_needle_document_layout():
    """The needle sits at the requested depth of the document, the question follows, the prime ends it."""
    captured = {}

    class Tok(_WordTokenizer):
        def apply_chat_template(self, messages, add_generation_prompt=True):
            captured["user"] = messages[0]["content"]
            return super().apply_chat_template(messages, add_generation_prompt)

    tok = Tok()
    fmt = FORMATS["magic-towns-primed"]
    for depth in (0.0, 0.5, 1.0):
        p = build_needle_prompt(tok, fmt, 400, seed=1, depth=depth)
        doc, question = captured["user"].split("\n\n")[1:]
        sentences = doc.split(". ")
        at = next(i for i, s in enumerate(sentences) if p.value in s)
        assert abs(at / (len(sentences) - 1) - depth) < 0.05
        assert p.key in question and p.value not in question
    with pytest.raises(ValueError, match="unknown needle format"):
        build_needle_prompt(tok, "nope", 100)
    with pytest.raises(ValueError, match="depth"):
        build_needle_prompt(tok, fmt, 100, depth=1.5)


@pytest.mark.slow
def test_smollm2_dense_finds_the_demo_needle():
    """The demo's default needle setting (format, seed, depth, --long-tokens) is one the model solves."""
    args = cli._parser().parse_args(["demo", "--dtype", "float32", "--max-new-tokens", "12"])
    pre = cli.load_model(args.model, args.dtype)
    p = build_needle_prompt(pre.tokenizer, DEMO_FORMAT, args.long_tokens, DEMO_SEED, DEMO_DEPTH)
    assert len(p.ids) > 1000
    out = cli.run_generation(pre, p.ids, args, "dense")
    answer = pre.tokenizer.decode(out.tokens[0], skip_special_tokens=True)
    assert contains_needle(answer, p.value), (p.value, answer)
