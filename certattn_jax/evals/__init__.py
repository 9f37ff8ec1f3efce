"""The paper's evaluation on a real model: perplexity, NIAH, RULER, the soundness audit, ablations and
certified aggressive compression (`python -m certattn_jax eval ...`; docs/evaluation.md)."""
