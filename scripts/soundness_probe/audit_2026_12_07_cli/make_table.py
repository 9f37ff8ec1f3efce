"""Builds table.md from results.tsv (one row per case run by run_case.sh) and the verdicts below."""
import re
from pathlib import Path

OK = "ok"
V = {
    "model_garbage_blocks_gguf": "silent wrong output (finite garbage in GGUF tensor data; GGUF has no checksum - known limit, low)",
    "model_ckpt_trunc": "ok message, then intermittent asyncio 'Event loop is closed' traceback at exit (low; 2nd run clean)",
    "gen_certs_ro": "fails only after generating (root: os.access says writable); text already printed (low)",
    "gen_eps_0": "accepted: every head rung 4, fraction_certified 0.0 (by design: eps>=0)",
    "gen_eps_gt1": "accepted (by design: eps is relative, no upper bound)",
    "gen_group5": "ok error, but suggests 'e.g. 1' while group_size must be >= 2 (low)",
    "gen_group3_cert": "ok error, but suggests 'e.g. 1' while group_size must be >= 2 (low)",
    "gen_block_huge": "OOM-KILLED (rc 137, ~22 GB RSS, no message): power-of-two block size never checked against context (HIGH)",
    "gen_block_16384": "SILENT: block 2x the context accepted; 11.4 GB max RSS, decode 0.3 tok/s (vs ~35) (HIGH, with gen_block_huge)",
    "gen_temp_huge": "accepted (finite; ~uniform sampling) - acceptable",
    "gen_stdin_nonutf8": "ok error, but position counts in the chat-templated text (118), not the user's input (low)",
    "gen_argv_nonutf8": "ok error, position 118 of templated text (low)",
    "gen_prompt_special": "special-token text in a --raw prompt is encoded as the special token (design choice)",
    "env_CERTATTN_VALUE_PACKING_bogus": "15-line import traceback (message at the end names the variable) (medium)",
    "env_CERTATTN_ADAPTIVE_STREAK__1": "import traceback (message names variable) (medium)",
    "env_CERTATTN_ADAPTIVE_STREAK_abc": "import traceback (message names variable) (medium)",
    "env_CERTATTN_FETCH_WHOLE_BELOW_abc": "import traceback, message 'invalid literal for int()' does NOT name the variable (medium)",
    "env_CERTATTN_FETCH_WHOLE_BELOW__5": "silently accepted (negative = off) (low)",
    "env_CERTATTN_FETCH_UNROLL_1_5": "import traceback, message does NOT name the variable (medium)",
    "env_CERTATTN_FETCH_UNROLL__3": "silently accepted (low)",
    "env_CERTATTN_FETCH_KERNEL_maybe": "import traceback (message names variable) (medium)",
    "env_CERTATTN_WRITE_KERNEL_bogus": "import traceback (message names variable) (medium)",
    "env_CERTATTN_HOT_USED_STACKED_bogus": "import traceback (message names variable) (medium)",
    "env_CERTATTN_PALLAS_INTERPRET_bogus": "silently accepted as ON; also '=off' means ON (inverse of every other switch) (medium)",
    "env_CERTATTN_STACKED_TUNING__nonexistent_json": "not read on CPU (GPU-only path) - not checked here",
    "env_CERTATTN_RUNG0_SELECT_bogus": "accepted on CPU: module with the check is imported only on the GPU path (low)",
    "env_CERTATTN_RUNG0_SINGLE_CHUNK_bogus": "accepted on CPU (GPU-only module) (low)",
    "env_CERTATTN_RUNG0_WARPS_3": "accepted on CPU (GPU-only module) (low)",
    "env_CERTATTN_RUNG0_CHUNK_7": "accepted on CPU (GPU-only module) (low)",
    "env_CERTATTN_SELFTEST_CACHE__nonexistent_dir_x_json": "not used on CPU",
    "env_CERTATTN_CACHE__nonexistent_ro_x": "ok (as root the dir was created, model re-downloaded by pip and converted; auditor removed it)",
    "env_CERTATTN_JAX_CACHE__proc_nope": "ok: one-line note 'compilation cache disabled', run continues",
    "demo_nnt0": "error only after part 1 ran; names max_new_tokens, not --needle-new-tokens (low)",
    "demo_long_huge": "error only after part 1 ran (low)",
    "demo_skip_eps": "policy flags silently ignored with --skip-comparison (generate refuses this) (low)",
    "conv_badparent": "error after loading the source; message names a temp file '/proc/.conv_c.tmp-*' (low)",
    "conv_out_under_file": "ok-ish: '[Errno 17] File exists' after loading the source (low)",
    "ev_len_abc": "one line but does not name --lengths ('invalid literal for int()') (low)",
    "ev_depth_float": "one line but does not name --depths (low)",
    "ev_sweep_abc": "one line but does not name --sweep-tau (low)",
    "ev_ok_ppl": "SUPERSEDED (tiny model, see ev_ppl_tinymodel_oov); out/ file holds the later run",
    "ev_out_isdir": "1st row: superseded; 2nd: TRACEBACK after compute, results lost (IsADirectoryError not caught) (medium)",
    "ev_summary_nodir": "1st row: superseded; 2nd: error only after compute (out JSON kept) (medium)",
    "ev_summary_isdir": "TRACEBACK after compute (IsADirectoryError) (medium)",
    "ev_plots_proc": "ppl with dense only: --plots unused, silently",
    "ev_audit_plots_bad": "error only AFTER compute and NO result JSON written: results lost (medium-high)",
    "ev_out_newdir": "ok (creates parents)",
    "ev_mnt_neg": "SILENT: --max-new-tokens -5 accepted, RULER sample generated 1 token and scored 0.0 (medium)",
    "ev_mnt_zero": "0 treated as 'no cap' silently (sample then skipped for length 256: unrelated) (low)",
    "ev_cap0": "--capacity 0 silently = default (low)",
    "ev_seed_huge": "accepted (numpy takes big ints); generate refuses > 2^63 (low, inconsistent)",
    "ev_seed_neg": "error after model load and does not name --seed ('expected non-negative integer') (low)",
    "ev_chunk_huge": "TRACEBACK (JaxRuntimeError: OOM allocating 721 GB): capacity derived from --prefill-chunk, unbounded (medium)",
    "ev_cap_huge": "ok message (multiple of chunk); capacity > context not checked",
    "ev_auditlog_isdir": "TRACEBACK IsADirectoryError (before compute) (low-medium)",
    "gen_tiny_oov": "ok: tokenizer ids beyond model vocab named",
    "ev_ppl_tinymodel_oov": "misleading: tokenizer/model vocab mismatch reported as 'activations overflowed' (medium)",
    "ok_dense": "ok: 'The capital of France is Paris.'",
    "ok_certified": "ok: same text; summary heads 1890 = 7 steps x 30 layers x 9 heads; histogram sums",
    "ok_json_cert": "ok: tokens == dense; summary matches --certificates file (check_json.out)",
    "known_cache_flipped": "ok: damaged cached checkpoint detected and rebuilt from the GGUF",
    "conv_ow_corrupt_src": "ok: failed conversion left the existing checkpoint intact",
}


def last_line(path: Path) -> str:
    lines = [l.rstrip() for l in path.read_text(errors="replace").splitlines() if l.strip()]
    lines = [l for l in lines if not re.match(r"^\s+\^+$", l)]
    s = lines[-1] if lines else ""
    s = re.sub(r".*\r", "", s)
    return (s[:160] + "...") if len(s) > 160 else s


rows = ["| id | rc | s | command | last line of output | verdict |", "|---|---|---|---|---|---|"]
for line in Path("results.tsv").read_text().splitlines():
    cid, rc, secs, cmd = line.split("\t", 3)
    cmd = cmd.replace(".venv/bin/python -m certattn_jax", "cajx")
    default = OK if rc in ("0", "2") else "CHECK"
    if cid.startswith(("help_",)):
        default = "ok (help printed)"
    rows.append("| {} | {} | {} | `{}` | {} | {} |".format(
        cid, rc, secs, cmd.replace("|", "\\|"), last_line(Path("out") / f"{cid}.txt").replace("|", "\\|"),
        V.get(cid, default)))
Path("table.md").write_text("\n".join(rows) + "\n")
print(len(rows) - 2, "rows")
