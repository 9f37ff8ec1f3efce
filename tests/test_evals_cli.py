"""`python -m certattn_jax eval ...` end to end on a one-layer cut of SmolLM2 (real tokenizer, real data)."""

import json

import pytest

from certattn_jax import cli


@pytest.mark.slow
def test_eval_ppl_and_niah_cli(tmp_path, capsys):
    common = ["--layers", "1", "--lengths", "192", "--samples", "1", "--capacity", "256", "--dtype", "float32"]
    out, summary = tmp_path / "ppl.json", tmp_path / "summary.json"
    assert cli.main(["eval", "ppl", "--cache", "dense,certified", "--ppl-steps", "6", "--out", str(out),
                     "--summary", str(summary), "--audit-log", str(tmp_path / "audit.jsonl"), *common]) == 0
    r = json.loads(out.read_text())
    row = r["ppl"]["per_length"]["192"]
    assert row["dense"]["tokens"] == row["certified"]["tokens"] == 6
    assert abs(row["certified"]["delta_vs_dense_percent"]) < 1.0
    audit = r["audit"]["certified"]
    assert audit["head_steps"] == 6 * 9 and audit["violations"] == 0  # 6 steps x 1 layer x 9 query heads
    assert sum(audit["rung_histogram"]) == audit["head_steps"] and audit["tightness_quantiles"]["p01"] >= 1.0
    s = json.loads(summary.read_text())
    assert set(s) >= {"model", "device", "ppl", "soundness"} and s["soundness"]["violations"] == 0
    assert len((tmp_path / "audit.jsonl").read_text().splitlines()) == 6

    niah = tmp_path / "niah.json"
    assert cli.main(["eval", "niah", "--cache", "dense", "--depths", "50", "--niah-new-tokens", "4",
                     "--out", str(niah), "--plots", str(tmp_path / "plots"), *common]) == 0
    n = json.loads(niah.read_text())["niah"]
    assert n["n"] == 1 and 0.0 <= n["accuracy"]["dense"] <= 1.0 and n["samples"][0]["prompt_tokens"] <= 192 - 4
    assert (tmp_path / "plots" / "niah_dense.png").stat().st_size > 1000


@pytest.mark.slow
def test_eval_ruler_audit_ablations_and_aggressive_cli(tmp_path):
    """The other jobs end to end, tiny (one layer, 256 tokens): each writes its part, and every certified head-step
    they audit is within its bound."""
    common = ["--layers", "1", "--lengths", "256", "--samples", "1", "--capacity", "320", "--prefill-chunk", "64",
              "--dtype", "float32"]
    jobs = {"ruler": ["--cache", "dense,naive,certified", "--tasks", "niah_single_1", "--max-new-tokens", "8"],
            "audit": ["--cache", "certified", "--ppl-steps", "4"],
            "ablations": ["--sweep-tau", "0.995", "--sweep-eps", "0.05", "--ppl-steps", "4"],
            "aggressive": ["--ppl-steps", "4", "--depths", "50", "--niah-new-tokens", "4"]}
    out = {}
    for job, args in jobs.items():
        path = tmp_path / f"{job}.json"
        assert cli.main(["eval", job, *args, *common, "--out", str(path)]) == 0, job
        out[job] = json.loads(path.read_text())
    scores = out["ruler"]["ruler"]["scores"]["niah_single_1"]["256"]
    assert set(scores) == {"dense", "naive", "certified"} and all(0 <= v <= 100 for v in scores.values())
    assert out["ruler"]["ruler"]["outputs"][0]["prompt_tokens"] <= 256 - 8
    audit = out["audit"]["audit"]["certified"]
    assert audit["head_steps"] == 4 * 9 and audit["violations"] == 0  # 4 steps x 1 layer x 9 query heads
    (sweep,) = out["ablations"]["ablations"]["sweep"]
    assert (sweep["tau_cov"], sweep["eps"], sweep["violations"]) == (0.995, 0.05, 0) and sweep["head_steps"] == 36
    agg = out["aggressive"]["aggressive"]
    assert set(agg["niah"]["accuracy"]) == {"dense", "naive K4V2", "certified K4V2"}
    assert agg["audit"]["certified K4V2"]["violations"] == 0
    assert {r["layout"] for r in agg["memory"]} == {"INT8/INT4", "K4V2"}


def test_eval_cli_errors_are_clear(capsys):
    assert cli.main(["eval", "ppl", "--cache", "dense,fast"]) == 2
    assert "--cache" in capsys.readouterr().err
    assert cli.main(["eval", "ruler", "--tasks", "qa_9"]) == 2
    assert "unknown RULER tasks" in capsys.readouterr().err
    assert cli.main(["eval", "niah", "--depths", "150"]) == 2
    assert "depths" in capsys.readouterr().err
    # checked before any run: a bad chunk, a bad swept value
    assert cli.main(["eval", "ppl", "--prefill-chunk", "0"]) == 2
    assert "--prefill-chunk must be >= 1" in capsys.readouterr().err
    assert cli.main(["eval", "ablations", "--sweep-eps=-1"]) == 2
    assert "must be >= 0" in capsys.readouterr().err


def test_eval_cli_checks_outputs_and_limits_before_the_run(tmp_path, capsys, monkeypatch):
    """Output paths, --max-new-tokens, --seed, --capacity and unparsable lists are refused before the model loads
    (a bad --out / --summary / --plots used to fail after the whole compute, losing it); lengths, capacity and
    prefill chunk beyond the model's context are refused before any cache exists (a 100000-token chunk asked for
    a 721 GB cache)."""
    import types

    def no_load(*a, **k):
        raise AssertionError("the model loaded before the arguments were checked")

    monkeypatch.setattr(cli, "load_model", no_load)
    a_file = tmp_path / "f.txt"
    a_file.write_text("x")
    early = [(["--out", str(tmp_path)], "--out"), (["--summary", str(tmp_path)], "--summary"),
             (["--audit-log", str(tmp_path)], "--audit-log"), (["--plots", str(a_file)], "--plots"),
             (["--out", str(a_file / "sub" / "x.json")], "--out"),
             (["--max-new-tokens", "-5"], "--max-new-tokens"), (["--max-new-tokens", "0"], "--max-new-tokens"),
             (["--seed", "-1"], "--seed"), (["--capacity", "0"], "--capacity"), (["--lengths", "abc"], "--lengths"),
             (["--depths", "12.5"], "--depths"), (["--sweep-tau", "x"], "--sweep-tau")]
    for extra, flag in early:
        assert cli.main(["eval", "ppl", "--out", str(tmp_path / "r.json"), *extra]) == 2, extra
        err = capsys.readouterr().err
        assert flag in err and "Traceback" not in err, (extra, err)

    config = types.SimpleNamespace(max_position_embeddings=500, num_layers=2, vocab_size=100)
    monkeypatch.setattr(cli, "load_model", lambda *a: types.SimpleNamespace(params={}, config=config,
                                                                             tokenizer=object()))
    late = [(["--lengths", "1024"], "exceeds the model's context of 500"),
            (["--lengths", "256", "--prefill-chunk", "100000"], "--prefill-chunk 100000 exceeds"),
            (["--lengths", "256", "--capacity", "4096"], "--capacity 4096 exceeds")]
    for extra, words in late:
        assert cli.main(["eval", "ppl", "--out", str(tmp_path / "p.json"), *extra]) == 2, extra
        assert words in capsys.readouterr().err, extra
    # accepted (they fail later, on the fake model's empty params): the whole context with a chunk it is no
    # multiple of (500 rounded up to 512: positions never pass 500), and a negative seed for the string-seeded jobs
    from certattn_jax.evals import session

    def reached(*a, **k):
        raise ValueError("the arguments passed")

    monkeypatch.setattr(session, "Session", reached)
    for job, extra in (("ppl", ["--lengths", "500"]), ("ruler", ["--lengths", "256", "--seed", "-1"])):
        assert cli.main(["eval", job, "--out", str(tmp_path / "q.json"), *extra]) == 2
        assert "the arguments passed" in capsys.readouterr().err, job
    assert cli.main(["eval", "ppl", "--out", str(tmp_path / "q.json"), "--lengths", "256", "--seed", "-1"]) == 2
    assert "--seed must lie in [0," in capsys.readouterr().err  # its windows are drawn by numpy


@pytest.mark.slow
def test_eval_memory_takes_lengths_beyond_the_context(tmp_path):
    """docs/evaluation.md's memory command: the memory job only counts bytes, so lengths past the model's context
    (SmolLM2: 8192) are fine there."""
    out = tmp_path / "mem.json"
    assert cli.main(["eval", "memory", "--lengths", "1024,8192,32768", "--layers", "1", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["memory"]
    assert {r["capacity"] for r in rows} >= {1024, 8192, 32768}
