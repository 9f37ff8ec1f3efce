#!/usr/bin/env bash
# One device call, many measurements: run the named steps in order, each under its own timeout, and pack what
# they wrote into $OUT/results.tgz after every step (so a call stopped at its limit still returns what finished).
# The step list is docs/performance.md's "Next GPU session" plan; each step's stdout+stderr goes to its log.
#     bash scripts/gpu_session.sh kernels prof gen_fused gen8b_32k      # on the device machine ($OUT set)
# Results land in $OUT/results.tgz (JSON, logs, HLO dumps with their launch/copy analyses) and $OUT/summary.log.
set -uo pipefail
cd "$(dirname "$0")/.."
export JAX_PLATFORMS=cuda XLA_FLAGS= XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT="${OUT:?OUT must name the folder that comes back}"
W=/tmp/gpu_session
mkdir -p "$W/hlo"
B="python3 scripts/bench_generate.py --timeout 150 --new-tokens 32 --tier1 pallas"

step() {  # step NAME SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout -k 5 "$limit" bash -c "$*" > "$W/$name.log" 2>&1
  local rc=$?
  echo "$(date -u +%H:%M:%S) $name rc=$rc $((SECONDS - t0))s" | tee -a "$OUT/summary.log"
  tail -n 4 "$W/$name.log" | sed 's/^/    /' >> "$OUT/summary.log"
  tar czf "$OUT/results.tgz" -C /tmp gpu_session
}

hlo_analyses() {
  for f in "$W"/hlo/*.hlo "$W"/hlo/*/*.hlo; do
    [ -e "$f" ] || continue
    python3 scripts/launches_by_scope.py "$f" > "$f.scopes.json" 2>&1
    python3 scripts/big_writes.py "$f" --min-bytes 1e6 > "$f.big_writes.json" 2>&1
  done
}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$OUT/summary.log"
python3 -c "import jax; print('jax', jax.__version__, jax.devices())" >> "$OUT/summary.log" 2>&1

for s in "$@"; do
  case $s in
    write_kernel)  # thirty-second session: the token-write kernel compiled (a sequence that takes no token: neither
      # its row nor its statistics written) against its reference
      step write_kernel 90 "python3 -m pytest -q -p no:benchmark tests/test_pallas_write_token.py" ;;
    regress4k)  # thirty-third session: SmolLM2 4K certified fell from 487.2 (twenty-eighth session, call C, tree 7f75265)
      # to 422.5 tokens/s (0.61x -> 0.53x dense) while 1K and 8B 8K moved ~2 %. Which change: the tree of call C
      # (.carry_old, carried: rm -rf .carry_old && mkdir .carry_old && git archive 7f75265 certattn_jax models
      # pallas_kernels scripts pyproject.toml | tar -x -C .carry_old) against this tree, alternated, and this tree
      # with the certify kernel's general form (CERTATTN_RUNG0_SINGLE_CHUNK=0: the twenty-ninth session's single-chunk
      # form, default since and never timed, is the first suspect). One row per step: a cut call keeps its rows.
      S4="${B/--timeout 150/--timeout 75} --new-tokens 64 --models smollm2 --prompts 4096"
      [ "${REGRESS_DENSE:-1}" = 1 ] && step rg_dense 70 "$S4 --caches dense --out $W/rg_4k_dense.json"
      for i in $(seq 1 "${REGRESS_ROUNDS:-2}"); do
        step rg_new_$i 70 "$S4 --caches certified --out $W/rg_4k_new_$i.json"
        step rg_old_$i 70 "cd .carry_old && PYTHONPATH=. $S4 --caches certified --out $W/rg_4k_old_$i.json"
        step rg_gen_$i 70 "CERTATTN_RUNG0_SINGLE_CHUNK=0 $S4 --caches certified --out $W/rg_4k_gen_$i.json"
      done ;;
    bisect4k)  # thirty-fourth session: if regress4k puts the 4K regression between 7f75265 and this tree, which half:
      # .carry_mid1 = 3003303 (after the single-chunk form and the unrolled bridge, before the soundness and bad-input
      # changes), .carry_mid2 = 19faaea (after them, before the lifecycle/sampling audits' fixes); alternated
      S4="${B/--timeout 150/--timeout 75} --new-tokens 64 --models smollm2 --prompts 4096"
      for i in 1 2; do
        step bi_new_$i 70 "$S4 --caches certified --out $W/bi_4k_new_$i.json"
        step bi_mid1_$i 70 "cd .carry_mid1 && PYTHONPATH=. $S4 --caches certified --out $W/bi_4k_mid1_$i.json"
        step bi_mid2_$i 70 "cd .carry_mid2 && PYTHONPATH=. $S4 --caches certified --out $W/bi_4k_mid2_$i.json"
      done ;;
    ab8b_unroll)  # thirty-fourth session: FIRST_PASS_UNROLLED=auto is "background" for 8B-sized layers (33 host round
      # trips per step looped, 1 unrolled); alternated against the looped pass ("0"), dense in the call
      S8="${B/--timeout 150/--timeout 85} --models llama3.1-8b --prompts 8192"
      [ "${AB8B_DENSE:-1}" = 1 ] && step u8_dense 80 "$S8 --caches dense --out $W/u8_dense.json"
      for i in $(seq 1 "${AB8B_ROUNDS:-2}"); do
        step u8_auto_$i 85 "$S8 --caches certified --out $W/u8_auto_$i.json"
        step u8_loop_$i 85 "CERTATTN_FIRST_PASS_UNROLLED=0 $S8 --caches certified --out $W/u8_loop_$i.json"
      done ;;
    dec128p)  # thirty-fourth session: issue 8's 8B 128K decode row with model-made K/V (the product's prefill: every
      # head-step at rung 0 or 1, unlike the Gaussian K/V's ladder), dense and certified each in its own process
      for c in dense certified; do
        step dec128p_$c 270 "python3 scripts/bench_decode.py --models llama3.1-8b --contexts 131072 --batches 1 --caches $c --impls einsum --kv prefill --prefill-chunk 512 --steps 16 --reps 3 --out $W/dec128p_$c.json"
      done ;;
    fits128)  # thirty-fourth/fifth sessions: issue 8's "a larger batch than dense fits" at 8B 128K on an 80 GB H100.
      # The thirty-fifth session's first try: jax's allocator stops at XLA_PYTHON_CLIENT_MEM_FRACTION (0.75 by default,
      # 60 GB here), so dense B=3 (51.5 GB of K/V + 16 GB of weights) ran out, and the empty certified B=4 cache made
      # its 34 GB tier-2 zeros on the device; both retried failing allocations until their timeouts. Now: the same
      # fraction (0.95) for both caches, tier 2's zeros made in host memory, groups converted into their rows, and
      # rows that cannot fit by their cache's bytes refused at once (bench_decode.check_fits).
      # On an H200 (141 GB device, 128 GiB host: the host fills before the device) the allocator is held to the H100's
      # limit (0.95 of 81,559 MiB) for both caches: the same device budget, the comparison an 80 GB card makes.
      MIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
      FR=$(python3 -c "print(0.95 if $MIB < 100000 else round(0.95 * 81559 / $MIB, 4))")
      echo "fits128: memory.total $MIB MiB, XLA_PYTHON_CLIENT_MEM_FRACTION=$FR" | tee -a "$OUT/summary.log"
      D="XLA_PYTHON_CLIENT_MEM_FRACTION=$FR python3 scripts/bench_decode.py --models llama3.1-8b --contexts 131072 --impls einsum --steps 8 --reps 2"
      if [ "${FITS_CERT_FIRST:-0}" = 1 ]; then  # a short call: the certified row first
        step fits_cert "${FITS_CERT_S:-260}" "$D --batches ${FITS_CERT_BATCHES:-4,5} --caches certified --staging-batch 1 --out $W/fits128_cert.json"
        step fits_dense 150 "$D --batches 3,4 --caches dense --out $W/fits128_dense.json"
      else
        step fits_dense 150 "$D --batches 3,4 --caches dense --out $W/fits128_dense.json"
        step fits_cert "${FITS_CERT_S:-260}" "$D --batches ${FITS_CERT_BATCHES:-4,5} --caches certified --staging-batch 1 --out $W/fits128_cert.json"
      fi
      [ "${FITS6:-1}" = 1 ] && step fits_cert6 150 "$D --batches 6 --caches certified --staging-batch 1 --out $W/fits128_cert6.json" ;;
    sound_staging)  # thirty-sixth session: the compiled soundness suites (12 workers) beside the staging tests (4), each
      # failure written as it happens (CERTATTN_FAILURE_LOG: a call cut at its limit keeps them), -rA names every result
      step sound_staging 560 "CERTATTN_FAILURE_LOG=$W/staging_failures.txt timeout 300 python3 -m pytest -q -rfE -n 4 tests/test_staging_groups.py > $W/staging_gpu.log 2>&1 & P=\$!; CERTATTN_FAILURE_LOG=$W/sound_failures.txt CERTATTN_TIER1=pallas CERTATTN_RUNG0=fused python3 -m pytest -q -rfE -n 12 --durations=15 tests/test_soundness.py tests/test_soundness_extreme.py tests/test_certify_rung0.py; wait \$P; tail -5 $W/staging_gpu.log" ;;
    issue7_smol)  # issue 7's named grid, SmolLM2 half (1K, 4K; dense / naive / certified, each row a fresh process)
      step issue7_smol 330 "python3 scripts/bench_generate.py --timeout 140 --new-tokens 64 --models smollm2 --prompts 1024 4096 --caches dense naive certified --out $W/issue7_smol.json" ;;
    issue7_8b)  # issue 7's named grid, LLaMA-3.1-8B-shape half (8K, 32K); merged with the SmolLM2 half into
      # results/bench_generate.json (bench_generate.py --merge) when both ran on the same machine
      # (rows written straight into $OUT as they finish: a call cut at its device-time limit keeps them)
      step issue7_8b 560 "python3 scripts/bench_generate.py --timeout 170 --new-tokens 64 --models llama3.1-8b --prompts 8192 32768 --caches dense naive certified --out $OUT/issue7_8b.json" ;;
    host_time)  # thirty-eighth session's plan: the conversion's host sections on the GPU machine (SmolLM2 1K shapes),
      # then where SmolLM2 1K's certified prefill time goes with the bench's one 1024-token chunk's model
      step host_time 120 "python3 scripts/probe_conversion_host_time.py --out $W/probe_conversion_host_time.json" ;;
    trace_prefill)  # thirty-ninth session: SmolLM2 1K's certified TTFT (1.45x): the prefill's programs on the device
      # and host timeline, dense against certified (bench_generate's one 1024-token chunk), raw traces kept in $OUT
      step trace_prefill 200 "python3 scripts/trace_prefill.py --model smollm2 --prompt 1024 --prefill-chunk 1024 --repeats 7 --keep-traces $OUT/traces --out $OUT/trace_prefill_smol1k.json; python3 scripts/trace_prefill.py --model smollm2 --prompt 4096 --prefill-chunk 1024 --repeats 5 --out $OUT/trace_prefill_smol4k.json" ;;
    trace4k)  # thirty-ninth session: SmolLM2 4K decode at 0.59x dense (issue 8 asks 0.8x): where a step's time goes
      step trace4k 200 "python3 scripts/trace_decode.py --model smollm2 --prompt 4096 --caches dense certified --steps 16 --out $OUT/trace_decode_smol4k.json" ;;
    ttft_fused)  # thirty-ninth session: the conversion inside the last prefill chunk's program (on by default on a GPU)
      # against the eager conversion after it (CERTATTN_PREFILL_CONVERSION_IN_CHUNK=0), SmolLM2 1K, one 1024-token
      # chunk as bench_generate; each a fresh process, alternated; the traces kept in $OUT
      T="python3 scripts/trace_prefill.py --model smollm2 --prompt 1024 --prefill-chunk 1024 --repeats 9"
      step ttft_fused 240 "$T --out $OUT/ttft_fused_on_1.json --keep-traces $OUT/traces_on; CERTATTN_PREFILL_CONVERSION_IN_CHUNK=0 $T --caches certified --out $OUT/ttft_fused_off_1.json --keep-traces $OUT/traces_off; $T --caches certified --out $OUT/ttft_fused_on_2.json; CERTATTN_PREFILL_CONVERSION_IN_CHUNK=0 $T --caches certified --out $OUT/ttft_fused_off_2.json" ;;
    issue7_smol_out)  # issue 7's SmolLM2 half, rows straight into $OUT as they finish
      step issue7_smol_out 330 "python3 scripts/bench_generate.py --timeout 140 --new-tokens 64 --models smollm2 --prompts 1024 4096 --caches dense certified naive --out $OUT/issue7_smol.json" ;;
    issue7_8b8k)  # issue 7's 8B 8K rows alone (dense and certified first), rows straight into $OUT as they finish
      step issue7_8b8k 400 "python3 scripts/bench_generate.py --timeout 170 --new-tokens 64 --models llama3.1-8b --prompts 8192 --caches dense certified naive --out $OUT/issue7_8b8k.json" ;;
    staging_gpu) step staging_gpu 330 "CERTATTN_FAILURE_LOG=$W/staging_failures.txt python3 -m pytest -q -rfE -n 8 tests/test_staging_groups.py" ;;
    ttft_groups)  # thirty-sixth session: the conversion in layer groups (one program for SmolLM2) against a layer at
      # a time (SmolLM2's 1K TTFT was 3.02x dense with a program per layer), both in one process, 1K and 4K
      step ttft_groups 200 "for p in 1024 4096; do python3 scripts/probe_ttft_phases.py --quick --model smollm2 --prompt \$p --repeats 7 --out $W/ttft_groups_\$p.json; done" ;;
    ttft_forms)  # thirty-seventh session: the conversion group's program batched (vmap, the new default) against the
      # lax.map loop and a layer at a time, in one process: SmolLM2 1K, then the 8B shape's 8K (7 layers per group)
      step ttft_forms 230 "python3 scripts/probe_ttft_phases.py --quick --model smollm2 --prompt 1024 --repeats 5 --out $W/ttft_forms_smol1k.json; python3 scripts/probe_ttft_phases.py --quick --model llama3.1-8b --prompt 8192 --repeats 3 --out $W/ttft_forms_8b8k.json" ;;
    ttft_sync)  # thirty-eighth session: the certified prefill's host syncs and eager dispatches after the conversion
      # removed (validate.checked_counts returns no mask outside jit, so `_poisoned` reads nothing back; the model
      # cache's fresh arrays in one program) against the tree before (.carry_old = ea0218a, carried, with this
      # probe copied in), SmolLM2 1K, where the host's time goes in each (--host-profile)
      P="python3 scripts/probe_ttft_phases.py --quick --host-profile --model smollm2 --prompt 1024 --repeats 5"
      step ttft_sync 240 "$P --out $W/ttft_new_smol1k.json; cd .carry_old && PYTHONPATH=. $P --out $W/ttft_old_smol1k.json" ;;
    ttft_8b)  # thirty-eighth session: the batched group form against the loop and a layer at a time at 8B 8K
      step ttft_8b 240 "python3 scripts/probe_ttft_phases.py --quick --host-profile --model llama3.1-8b --prompt 8192 --repeats 3 --out $W/ttft_forms_8b8k.json" ;;
    kernels) step kernels 180 "python3 -m pytest -q -n 8 -x tests/test_certify_rung0.py tests/test_pallas_tier1.py" ;;
    probe_int) step probe_int 150 "python3 scripts/probe_int_dot.py --out $W/probe_int_dot.json" ;;
    kernels_all) step kernels_all 200 "python3 -m pytest -q -n 8 tests/test_certify_rung0.py tests/test_pallas_tier1.py" ;;
    prof) step prof 300 "python3 scripts/profile_cert_step.py --shapes smol:1024 8b:32768 8b:131072 --tier1 pallas fused --phases tier1 fast --steps 30 --reps 3 --dump-hlo $W/hlo --out $W/prof_v3.json" ;;
    gen_fused) step gen_fused 330 "$B --models smollm2 --prompts 1024 4096 --caches certified --rung0 fused --dump-hlo $W/hlo --out $W/gen_smol_fused.json" ;;
    gen_smol) step gen_smol 560 "$B --models smollm2 --prompts 1024 4096 --caches dense naive certified --dump-hlo $W/hlo --out $W/gen_smol.json" ;;
    gen8b_32k) step gen8b_32k 400 "$B --models llama3.1-8b --prompts 32768 --caches naive certified --dump-hlo $W/hlo --out $W/gen_8b_32k.json" ;;
    gen8b_32k_fused) step gen8b_32k_fused 240 "$B --models llama3.1-8b --prompts 32768 --caches certified --rung0 fused --dump-hlo $W/hlo --out $W/gen_8b_32k_fused.json" ;;
    gen8b_8k) step gen8b_8k 330 "$B --models llama3.1-8b --prompts 8192 --caches dense certified --out $W/gen_8b_8k.json" ;;
    att_rest) step att_rest 400 "python3 scripts/bench_attention.py --contexts 8192,65536 --out $W/att_rest.json" ;;
    att_rungs) step att_rungs 300 "python3 scripts/bench_attention.py --contexts 32768 --batches 1 --impls pallas_dense_bf16 certified_full certified_rung1 certified_rung2 certified_rung3 certified_rung4 --out $W/att_rungs.json" ;;
    warm8b)  # thirteenth session: the compiler's one-time setup paid at the prefill (selftest.warm_compiler); the
      # second process keeps the first's verdicts, so no check compiles a kernel during its prefill (23.4 s before)
      step warm8b 400 "for i in 1 2; do python3 scripts/bench_generate.py --timeout 190 --new-tokens 16 --models llama3.1-8b --prompts 8192 --caches certified --out $W/warm8b_\$i.json; done" ;;
    dec128)  # thirteenth session: the 128K rows each in a process of its own (in one process after the 32K rows,
      # naive and certified failed allocating 57 GiB), then the 32K batch rows
      step dec128 560 "for c in dense naive certified; do python3 scripts/bench_decode.py --models llama3.1-8b --contexts 131072 --batches 1 --caches \$c --impls einsum --out $W/dec128_\$c.json; done" ;;
    dec32b) step dec32b 500 "for c in dense naive certified; do python3 scripts/bench_decode.py --models llama3.1-8b --contexts 32768 --batches 8,16 --caches \$c --impls einsum --out $W/dec32b_\$c.json; done" ;;
    dec) step dec 300 "python3 scripts/bench_decode.py --models llama3.1-8b --contexts 32768 --batches 1 --caches dense,naive,certified --impls einsum --out $W/dec.json" ;;  # 128K: dec128; batches: dec32b
    why_certify)  # fifteenth session: the fused rung 0 kernel by kernel (traced), k_max 1 against 8 with 8 hot slots:
      # how much of the certify kernel is its k_max selection passes
      step why_certify 420 "python3 scripts/profile_cert_step.py --shapes smol:1024 8b:8192 8b:32768 --tier1 fused --phases tier1 rung0 --k-max 1 8 --steps 30 --reps 3 --trace $W/trace_certify --out $W/why_certify.json" ;;
    tune_small)  # fifteenth session: the fast pass's two launches at 8K (never tuned there: 1 block per split by
      # default) and the certify kernel's warps / chunk at each size, fewer warps included
      step t1_8k 300 "python3 scripts/probe_tier1_features.py --contexts 8192,32768 --variants features:plain,features:delta_hot,features:delta_hot_slots,features:full,full:bps1,full:bps2,full:bps4,full:bps8,full:stages3,full:warps4,full:bps4_stages3 --out $W/t1_8k.json"
      step cert_smol 200 "python3 scripts/profile_cert_step.py --shapes smol:1024 --tier1 fused --phases rung0 --rung0-variants 256x4 64x1 64x2 32x1 32x2 64x4 --out $W/cert_smol.json"
      step cert_8k 240 "python3 scripts/profile_cert_step.py --shapes 8b:8192 --tier1 fused --phases rung0 --rung0-variants 128x8 128x4 128x2 64x2 64x4 32x1 32x2 --out $W/cert_8k.json"
      step cert_32k 240 "python3 scripts/profile_cert_step.py --shapes 8b:32768 --tier1 fused --phases rung0 --rung0-variants 128x8 128x4 64x4 64x2 256x8 --out $W/cert_32k.json" ;;
    autotune_levels)  # fifteenth session: the 8B decode compile at GEMM autotune levels 1 and 2 (no buffer checks)
      # against the default (4) in the same call: does a cheaper autotuning keep the tuned GEMMs' speed?
      step autotune_levels 420 "for l in 4 1 2; do XLA_FLAGS=--xla_gpu_autotune_level=\$l python3 scripts/bench_generate.py --timeout 130 --new-tokens 16 --models llama3.1-8b --prompts 8192 --caches certified --out $W/autotune\${l}_8b8k.json; done" ;;
    no_triton_gemm)  # fifteenth session: the 8B decode compile with XLA's Triton GEMM fusions off (cuBLAS only:
      # fewer candidates to autotune), certified and dense, tokens/s in the same call
      step no_triton_gemm 330 "for c in certified dense; do XLA_FLAGS=--xla_gpu_enable_triton_gemm=false python3 scripts/bench_generate.py --timeout 130 --new-tokens 16 --models llama3.1-8b --prompts 8192 --caches \$c --out $W/no_triton_gemm_\${c}_8b8k.json; done" ;;
    dec32_prefill)  # fifteenth session: issue 8's 32K decode rows with model-made K/V (bench_decode --kv prefill):
      # the certified row times the fast pass, not the ladder on Gaussian noise
      step dec32_prefill 400 "python3 scripts/bench_decode.py --models llama3.1-8b --contexts 32768 --batches 1 --caches dense,certified,naive --impls einsum --kv prefill --steps 16 --reps 3 --out $W/dec32_prefill.json" ;;
    bps_e2e)  # fifteenth session's plan: the fast pass's split rule end to end (default against "fewer"), SmolLM2
      # 1K / 4K and 8B 8K certified, one process per setting; then the 8B layer's phases at 4K / 8K both ways
      step bps_e2e 560 "for r in programs fewer; do CERTATTN_TIER1_BPS=\$r $B --models smollm2 --prompts 1024 4096 --caches certified --out $W/bps_\${r}_smol.json; CERTATTN_TIER1_BPS=\$r $B --models llama3.1-8b --prompts 8192 --caches certified --out $W/bps_\${r}_8b8k.json; done"
      step bps_phases 300 "for r in programs fewer; do CERTATTN_TIER1_BPS=\$r python3 scripts/profile_cert_step.py --shapes 8b:4096 8b:8192 smol:4096 --tier1 fused --phases rung0 --out $W/bps_phases_\$r.json; done" ;;
    sound_bps)  # the compiled soundness suites and kernel tests with the "fewer" rule (before it may be a default)
      step sound_bps 460 "CERTATTN_TIER1_BPS=3 CERTATTN_TIER1=pallas CERTATTN_RUNG0=fused python3 -m pytest -q -n 16 -p no:benchmark tests/test_soundness.py tests/test_soundness_extreme.py tests/test_certify_rung0.py" ;;
    dec_prefill)  # issue 8's decode rows with model-made K/V: 128K batch 1 (one process per cache), 32K batch 8
      step dec128_prefill 560 "for c in dense naive certified; do python3 scripts/bench_decode.py --models llama3.1-8b --contexts 131072 --batches 1 --caches \$c --impls einsum --kv prefill --steps 16 --reps 3 --out $W/dec128_prefill_\$c.json; done"
      step dec32b_prefill 500 "for c in dense naive certified; do python3 scripts/bench_decode.py --models llama3.1-8b --contexts 32768 --batches 8 --caches \$c --impls einsum --kv prefill --steps 16 --reps 3 --out $W/dec32b_prefill_\$c.json; done" ;;
    gemm_pair)  # the 8B compile: dense and certified with cuBLAS-only GEMMs at 64 tokens (same call), and what the
      # autotuner tunes in each program
      step gemm_pair 500 "for f in '' --xla_gpu_enable_triton_gemm=false; do for c in dense certified; do XLA_FLAGS=\"\$f --xla_gpu_dump_autotune_results_to=$W/autotune_\${c}\${f:+_cublas}.txt\" python3 scripts/bench_generate.py --timeout 130 --new-tokens 64 --models llama3.1-8b --prompts 8192 --caches \$c --out $W/gemm_\${c}\${f:+_cublas}.json; done; done" ;;
    mm_tune)  # nineteenth session: the stacked-weight GEMM kernel's settings (the MMA path on a padded row, k tiles
      # loaded together, more splits) per 8B / SmolLM2 GEMM; the fastest checked one per shape is picked into
      # $W/stacked_tuning.json (CERTATTN_STACKED_TUNING); the layer-loop forms with it; then end to end, one process
      # per row: 8B 8K certified kernel / switch / kernel, SmolLM2 1K dense, certified stacked copy, kernel
      T1="0:0:0:4:3,0:0:0:4:3:2,0:64:0:4:3:2,0:64:0:4:4:2,0:128:0:4:4:2,0:64:0:8:4:2,0:64:0:2:4:2,0:64:0:4:4:2:2,0:0:0:4:3:0:2,0:64:0:4:3:0:4,0:64:0:2:4:0:2,0:64:0:4:3:1:2,64:64:0:4:3:0:2,0:64:4:4:3:0,0:64:8:4:3:0,0:64:8:4:4:2,0:32:0:4:4:2,256:64:0:8:4:2,0:128:0:4:5:2"
      T8="0:0:0:4:3,0:64:0:4:3,0:64:0:4:4,0:64:0:4:4:0:2,0:64:8:4:4,0:32:0:4:4,0:128:0:4:4,0:64:0:2:4,256:64:0:8:4"
      P="python3 scripts/probe_stacked_matmul.py --repeats 7"
      step mm_probe 200 "$P --models llama3.1-8b --batches 1 --tilings $T1 --out $W/mm_8b_m1.json && $P --models llama3.1-8b --batches 8 --tilings $T8 --out $W/mm_8b_m8.json && $P --models smollm2 --batches 1 --tilings $T1 --out $W/mm_smol_m1.json && python3 scripts/pick_stacked_tiling.py $W/mm_8b_m1.json $W/mm_8b_m8.json $W/mm_smol_m1.json --out $W/stacked_tuning.json"
      export CERTATTN_STACKED_TUNING=$W/stacked_tuning.json
      step mm_loop 150 "python3 scripts/probe_layer_loop.py --grid llama3.1-8b:8192,smollm2:1024 --forms unrolled,loop_switch,loop_pallas --out $W/mm_loop.json"
      G="python3 scripts/bench_generate.py --timeout 130 --new-tokens 64"
      step mm_e2e 330 "i=0; for m in kernel switch kernel; do i=\$((i+1)); CERTATTN_LOOPED_WEIGHTS=\$m $G --models llama3.1-8b --prompts 8192 --caches certified --out $W/mm_e2e_8b_\${i}_\$m.json; done; $G --models smollm2 --prompts 1024 --caches dense certified --out $W/mm_e2e_smol_stacked.json; CERTATTN_LOOPED_WEIGHTS=kernel $G --models smollm2 --prompts 1024 --caches certified --out $W/mm_e2e_smol_kernel.json" ;;
    glue_view)  # nineteenth session's call 2: the tuned stacked-weight kernel compiled (its tests, the model decoding
      # through it); 8B 8K with CERTATTN_LOOPED_WEIGHTS=kernel under the schedules that need no per-layer
      # conditional once no weight switch is left (adaptive, straight-looped) against looped, dense first; then the
      # default SmolLM2 1K certified step traced (the "auto" weights: the kernel for small layers)
      step mm_tests 150 "python3 -m pytest -q -x tests/test_pallas_stacked_matmul.py tests/test_e2e_cache.py -k 'stacked or looped_body'"
      G="python3 scripts/bench_generate.py --timeout 130 --new-tokens 64 --models llama3.1-8b --prompts 8192"
      step sched8b_kernel 330 "$G --caches dense --out $W/k8_dense.json; for c in certified certified_adaptive certified_straight-looped; do CERTATTN_LOOPED_WEIGHTS=kernel $G --caches \$c --out $W/k8_\$c.json; done"
      step smol_trace 150 "python3 scripts/trace_decode.py --model smollm2 --prompt 1024 --caches dense certified --steps 16 --out $W/trace_smol_auto.json" ;;
    stacked_mm)  # eighteenth session: the stacked-weight GEMM kernel (pallas_kernels.stacked_matmul) against XLA's GEMMs
      # on per-layer buffers, per 8B GEMM and tiling; then whole dense decode steps: unrolled, loop (XLA copies
      # w[i]), loop_switch (the certified looped schedule's one switch per layer), loop_pallas (w[i] in place)
      step stacked_mm 240 "python3 scripts/probe_stacked_matmul.py --models llama3.1-8b --batches 1,8 --out $W/stacked_mm_8b.json && python3 scripts/probe_stacked_matmul.py --models smollm2 --batches 1 --out $W/stacked_mm_smol.json"
      step loop_pallas 240 "python3 scripts/probe_layer_loop.py --grid llama3.1-8b:8192,smollm2:1024 --forms unrolled,loop,loop_switch,loop_pallas --out $W/loop_pallas.json" ;;
    kernel_e2e)  # eighteenth session's second call: the stacked-weight kernel's tilings (tile accumulation at M = 1),
      # the layer-loop forms with a first-step agreement check, then CERTATTN_LOOPED_WEIGHTS=kernel end to end:
      # SmolLM2 1K (stacked copy vs kernel, dense in the same call) and 8B 8K (per-layer switch vs kernel)
      step sm_tiles 150 "python3 scripts/probe_stacked_matmul.py --models llama3.1-8b --batches 1 --tilings 0:0:0:4:3:0,0:0:0:4:3:1,0:64:0:4:3:1,0:64:0:2:4:1,0:128:0:8:3:1,256:64:0:4:3:1,0:64:0:4:4:1,0:64:0:2:4:0,256:64:0:8:3:0 --out $W/sm_tiles_8b.json"
      step loop_pallas2 150 "python3 scripts/probe_layer_loop.py --grid llama3.1-8b:8192,smollm2:1024 --forms loop,loop_switch,loop_pallas,unrolled --out $W/loop_pallas2.json"
      G="python3 scripts/bench_generate.py --timeout 130 --new-tokens 64"
      step kernel_gen 420 "$G --models smollm2 --prompts 1024 --caches dense certified --out $W/kgen_smol_stacked.json; CERTATTN_LOOPED_WEIGHTS=kernel $G --models smollm2 --prompts 1024 --caches certified --out $W/kgen_smol_kernel.json; CERTATTN_LOOPED_WEIGHTS=kernel $G --models llama3.1-8b --prompts 8192 --caches certified --out $W/kgen_8b_kernel.json; $G --models llama3.1-8b --prompts 8192 --caches certified --out $W/kgen_8b_switch.json" ;;
    fewer_pair)  # eighteenth session: the "fewer" split rule against "programs" at 8B 8K, alternated, one process per
      # row (the seventeenth session's one sample: 98.5 against 93.5 tokens/s), dense first for the compile target
      step fewer_pair 330 "python3 scripts/bench_generate.py --timeout 130 --new-tokens 64 --models llama3.1-8b --prompts 8192 --caches dense --out $W/fewer_pair_0_dense.json; i=0; for r in fewer programs fewer; do i=\$((i+1)); CERTATTN_TIER1_BPS=\$r python3 scripts/bench_generate.py --timeout 130 --new-tokens 64 --models llama3.1-8b --prompts 8192 --caches certified --out $W/fewer_pair_\${i}_\$r.json; done" ;;
    fusion_at)  # sixteenth session: XLA autotunes every fusion (native vs block-level emitter: 817 entries in the 8B
      # certified program against 294 in dense, gemm_pair's dumps); the compile and the speed with that autotuner
      # off, dense and certified, 8B 8K and SmolLM2 1K, one process per row; then the "fewer" split rule at 8B 8K
      G="python3 scripts/bench_generate.py --timeout 130 --new-tokens 64"
      step fusion_at 570 "for f in '' --xla_gpu_experimental_enable_fusion_autotuner=false; do XLA_FLAGS=\"\$f\" $G --models llama3.1-8b --prompts 8192 --caches dense certified --out $W/fat_8b\${f:+_off}.json; XLA_FLAGS=\"\$f\" $G --models smollm2 --prompts 1024 --caches dense certified --out $W/fat_smol\${f:+_off}.json; done; CERTATTN_TIER1_BPS=fewer $G --models llama3.1-8b --prompts 8192 --caches certified --out $W/fewer_8b.json" ;;
    autotune0)  # fifteenth session: the 8B decode program's XLA compile with GEMM autotuning off (issue 7's compile)
      step autotune0 300 "XLA_FLAGS=--xla_gpu_autotune_level=0 python3 scripts/bench_generate.py --timeout 190 --new-tokens 16 --models llama3.1-8b --prompts 8192 --caches certified --out $W/autotune0_8b8k.json" ;;
    soak) step soak 400 "python3 scripts/bench_decode.py --models llama3.1-8b --contexts 32768 --batches 1 --caches certified --impls einsum --soak-steps 10000 --out $W/soak.json" ;;
    sound)  # 462 s with 12 workers on an H100 (thirty-sixth session); failures written as they happen
      step sound 560 "CERTATTN_FAILURE_LOG=$W/sound_failures.txt CERTATTN_TIER1=pallas CERTATTN_RUNG0=fused python3 -m pytest -q -rfE -n 16 --durations=12 tests/test_soundness.py tests/test_soundness_extreme.py tests/test_certify_rung0.py" ;;
    kernels_fix) step kernels_fix 120 "python3 -m pytest -q -n 4 tests/test_pallas_tier1.py -k 'subnormal or leaves_the_hot or slot_programs or any_size'" ;;
    eval_compile) step eval_compile 300 "python3 scripts/probe_eval_compile.py --model smollm2 --schedules looped two-pass --out $W/eval_compile.json" ;;
    trace) step trace 300 "python3 scripts/trace_decode.py --model smollm2 --prompt 1024 --caches dense certified:pallas:jnp certified:pallas:fused --steps 16 --out $W/trace_decode.json" ;;
    gen_straight) step gen_straight 330 "${B/--timeout 150/--timeout 240} --models smollm2 --prompts 1024 --caches dense certified_straight --rung0 fused --out $W/gen_straight.json" ;;
    gen_twopass) step gen_twopass 500 "${B/--timeout 150/--timeout 240} --models smollm2 --prompts 1024 --caches certified certified_two-pass --rung0 fused --out $W/gen_twopass.json" ;;
    gen_straight_cmdbuf) step gen_straight_cmdbuf 500 "XLA_FLAGS=--xla_gpu_enable_command_buffer=+CONDITIONAL,+WHILE ${B/--timeout 150/--timeout 240} --models smollm2 --prompts 1024 --caches certified certified_straight --rung0 fused --out $W/gen_straight_cmdbuf.json" ;;
    rung1_real) step rung1_real 280 "export JAX_PLATFORMS=cuda,cpu; python3 scripts/probe_rung1.py --length 2048 --steps 64 --samples 1 --out $W/rung1_8.json && python3 scripts/probe_rung1.py --length 2048 --steps 64 --samples 1 --hot-slots 16 --out $W/rung1_16.json" ;;
    rung1_whole) step rung1_whole 200 "export JAX_PLATFORMS=cuda,cpu; CERTATTN_FETCH_WHOLE_BELOW=100000000 python3 scripts/probe_rung1.py --length 2048 --steps 64 --samples 1 --hot-slots 16 --out $W/rung1_16_whole.json" ;;
    trace_straight) step trace_straight 240 "python3 scripts/trace_decode.py --model smollm2 --prompt 1024 --caches certified_straight:pallas:fused certified:pallas:fused --steps 16 --out $W/trace_straight.json" ;;
    eval_ppl12k) step eval_ppl12k 560 "export JAX_PLATFORMS=cuda,cpu; python3 -m certattn_jax eval ppl --lengths 8192 --samples 48 --ppl-steps 256 --cache dense,dense-reduce,certified --no-audit --out $W/eval_h200_ppl_8k_12k_tokens.json" ;;
    cmdbuf) step cmdbuf 200 "python3 scripts/probe_cmdbuf.py --out $W/probe_cmdbuf.json" ;;
    gen_sl) step gen_sl 200 "${B/--timeout 150/--timeout 180} --models smollm2 --prompts 1024 --caches dense certified_straight-looped --rung0 fused --out $W/gen_sl.json" ;;
    gen_sl_cb) step gen_sl_cb 200 "XLA_FLAGS=--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL ${B/--timeout 150/--timeout 180} --models smollm2 --prompts 1024 --caches dense certified_straight-looped --rung0 fused --out $W/gen_sl_cb.json" ;;
    gen_straight_cb) step gen_straight_cb 330 "XLA_FLAGS=--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN ${B/--timeout 150/--timeout 240} --models smollm2 --prompts 1024 --caches dense certified_straight --rung0 fused --out $W/gen_straight_cb.json" ;;
    trace_sl) step trace_sl 250 "python3 scripts/trace_decode.py --model smollm2 --prompt 1024 --caches dense certified_straight-looped:pallas:fused certified:pallas:fused --steps 16 --out $W/trace_sl.json" ;;
    gen_sl_off) step gen_sl_off 200 "XLA_FLAGS=--xla_gpu_enable_command_buffer= ${B/--timeout 150/--timeout 180} --models smollm2 --prompts 1024 --caches dense certified_straight-looped --rung0 fused --out $W/gen_sl_off.json" ;;
    gen_sl_fc) step gen_sl_fc 200 "XLA_FLAGS=--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN ${B/--timeout 150/--timeout 180} --models smollm2 --prompts 1024 --caches dense certified_straight-looped --rung0 fused --out $W/gen_sl_fc.json" ;;
    gen_sl_jnp) step gen_sl_jnp 150 "${B/--timeout 150/--timeout 140} --models smollm2 --prompts 1024 --caches certified_straight-looped certified --rung0 jnp --out $W/gen_sl_jnp.json" ;;
    rung1_modes)  # this session's second call: one probe with both rung-1 options, then issue 9's K4V2 grid
      step rung1_iu 90 "export JAX_PLATFORMS=cuda,cpu; CERTATTN_HOT_REFRESH=immediate CERTATTN_FETCH_UNROLL=64 python3 scripts/probe_rung1.py --length 2048 --steps 64 --samples 1 --hot-slots 16 --out $W/rung1_16_immediate_unrolled.json"
      step k4v2 250 "export JAX_PLATFORMS=cuda,cpu; python3 -m certattn_jax eval aggressive --lengths 2048,8192 --samples 3 --ppl-steps 128 --depths 0,50,100 --niah-new-tokens 16 --out $W/eval_h200_k4v2.json --plots $W/plots_k4v2" ;;
    k4v2) step k4v2 330 "export JAX_PLATFORMS=cuda,cpu; python3 -m certattn_jax eval aggressive --lengths 2048,8192 --samples 3 --ppl-steps 128 --depths 0,50,100 --niah-new-tokens 16 --out $W/eval_h200_k4v2.json --plots $W/plots_k4v2" ;;
    att_rung1_fetch) step att_rung1_fetch 240 "B2='python3 scripts/bench_attention.py --contexts 32768 --batches 1 --impls pallas_dense_bf16 certified_rung1'; \$B2 --out $W/att_rung1_loop.json && CERTATTN_FETCH_UNROLL=256 \$B2 --out $W/att_rung1_unrolled.json" ;;
    probe_host) step probe_host 70 "python3 scripts/probe_host_kernel.py --out $W/probe_host_kernel.json" ;;
    gen_adaptive) step gen_adaptive 300 "${B/--timeout 150/--timeout 200} --models smollm2 --prompts 1024 --caches dense certified_adaptive certified --rung0 fused --out $W/gen_adaptive.json" ;;
    rung1_adaptive) step rung1_adaptive 170 "export JAX_PLATFORMS=cuda,cpu; R='python3 scripts/probe_rung1.py --length 2048 --steps 64 --samples 1 --hot-slots 16'; \$R --schedule looped --out $W/rung1_16_looped.json && \$R --schedule adaptive --out $W/rung1_16_adaptive.json" ;;
    rung1_sl) step rung1_sl 100 "export JAX_PLATFORMS=cuda,cpu; python3 scripts/probe_rung1.py --length 2048 --steps 64 --samples 1 --hot-slots 16 --schedule straight-looped --out $W/rung1_16_straight_looped.json" ;;
    gen_sched) step gen_sched 290 "${B/--timeout 150/--timeout 200} --models smollm2 --prompts 1024 --caches dense certified_straight-looped certified_adaptive certified --rung0 fused --out $W/gen_sched.json" ;;
    ttft) step ttft 130 "python3 scripts/bench_ttft.py --models smollm2 --prompts 1024 4096 --rounds 15 --out $W/bench_ttft.json" ;;
    probe_selftest) step probe_selftest 150 "python3 scripts/probe_selftest.py --block-sizes 16 64 --head-dims 32 64 --k-max 1 2 8 --out $W/probe_selftest.json" ;;
    kgather) step kgather 150 "python3 -m pytest -q -n 4 tests/test_pallas_gather.py && CERTATTN_FETCH_KERNEL=1 python3 -m pytest -q -n 8 tests/test_certified_cache.py" ;;
    att_rung1_k) step att_rung1_k 200 "B2='python3 scripts/bench_attention.py --contexts 32768 --batches 1 --impls pallas_dense_bf16 certified_rung1'; CERTATTN_FETCH_KERNEL=1 \$B2 --out $W/att_rung1_kernel.json && \$B2 --out $W/att_rung1_loop.json" ;;
    rung1_kernel) step rung1_kernel 240 "export JAX_PLATFORMS=cuda,cpu CERTATTN_FETCH_KERNEL=1; R='python3 scripts/probe_rung1.py --length 2048 --steps 64 --samples 1 --hot-slots 16'; \$R --schedule looped --out $W/rung1_16_looped_kernel.json && CERTATTN_HOT_REFRESH=immediate \$R --schedule looped --out $W/rung1_16_looped_kernel_immediate.json && \$R --schedule adaptive --out $W/rung1_16_adaptive_kernel.json" ;;
    gen_cache) step gen_cache 200 "export JAX_COMPILATION_CACHE_DIR=/tmp/jaxcc JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=0; G='${B/--timeout 150/--timeout 150} --models smollm2 --prompts 1024 --caches dense certified_adaptive --rung0 fused'; \$G --out $W/gen_cache_first.json && \$G --out $W/gen_cache_second.json" ;;
    kfail) step kfail 150 "for k in 0 1; do CERTATTN_FETCH_KERNEL=\$k python3 -m pytest -q -n 8 tests/test_certified_cache.py -k 'rung_3_exact_head_and_rung_4_exact_layer or refreshes_hot_sets_after_the_step' > $W/kfail_\$k.log 2>&1; echo fetch_kernel=\$k; tail -2 $W/kfail_\$k.log; done" ;;
    gen_auto) step gen_auto 170 "python3 scripts/bench_generate.py --timeout 120 --new-tokens 32 --models smollm2 --prompts 1024 --caches dense certified certified_adaptive --out $W/gen_auto.json" ;;
    sound_k) step sound_k 460 "CERTATTN_FETCH_KERNEL=1 python3 -m pytest -q -n 16 --durations=12 tests/test_soundness.py tests/test_soundness_extreme.py tests/test_certified_cache.py tests/test_pallas_gather.py" ;;
    kcompile) step kcompile 260 "python3 scripts/probe_kernel_compile.py --shapes smol:1024 8b:32768 --k-max 8 2 --out $W/probe_kernel_compile.json" ;;
    kgather2) step kgather2 200 "python3 -m pytest -q -n 4 tests/test_pallas_gather.py && python3 -m pytest -q -n 4 tests/test_pallas_selftest.py -k 'gather or fetch' && python3 -m pytest -q -n 8 tests/test_certified_cache.py" ;;
    rung1_default) step rung1_default 240 "export JAX_PLATFORMS=cuda,cpu; R='python3 scripts/probe_rung1.py --length 2048 --steps 64 --samples 1 --hot-slots 16'; \$R --schedule looped --out $W/rung1_16_looped_default.json && CERTATTN_HOT_REFRESH=immediate \$R --schedule looped --out $W/rung1_16_looped_default_immediate.json && \$R --schedule adaptive --out $W/rung1_16_adaptive_default.json" ;;
    niah5) step niah5 330 "export JAX_PLATFORMS=cuda,cpu; python3 -m certattn_jax eval niah --lengths 2048,8192 --depths 0,25,50,75,100 --samples 5 --niah-new-tokens 16 --out $W/eval_h200_niah_5_per_cell.json --plots $W/plots_niah5" ;;
    rolled) step rolled_kernels 150 "python3 -m pytest -q -n 8 tests/test_certify_rung0.py; python3 -m pytest -q -n 4 tests/test_pallas_selftest.py -k 'gather or fetch'"
      step rolled_compile 90 "python3 scripts/probe_kernel_compile.py --shapes smol:1024 --k-max 8 --out $W/probe_kernel_compile_rolled.json"
      step rolled_gen 260 "${B/--timeout 150/--timeout 120} --models smollm2 --prompts 1024 --caches dense certified_straight-looped certified_adaptive --rung0 fused --out $W/gen_rolled.json" ;;
    rolled2)  # the rolled certify kernel's compile with the self-checks paid (process 1) and cached on disk (process 2)
      step rolled_fresh 110 "${B/--timeout 150/--timeout 100} --models smollm2 --prompts 1024 --caches certified_straight-looped --rung0 fused --out $W/gen_rolled_fresh.json"
      step rolled_cached 160 "${B/--timeout 150/--timeout 70} --models smollm2 --prompts 1024 --caches dense certified_straight-looped certified_adaptive --rung0 fused --out $W/gen_rolled_cached.json" ;;
    tau_gpu) step tau_gpu 560 "export JAX_PLATFORMS=cuda,cpu; python3 -m certattn_jax eval ablations --lengths 4096 --samples 2 --ppl-steps 128 --sweep-tau 0.9,0.99,0.995,0.999 --sweep-eps 0.05 --out $W/eval_h200_tau_sweep_4k.json" ;;
    niah5_1k4k) step niah5_1k4k 330 "export JAX_PLATFORMS=cuda,cpu; python3 -m certattn_jax eval niah --lengths 1024,4096 --depths 0,25,50,75,100 --samples 5 --niah-new-tokens 16 --out $W/eval_h200_niah_5_per_cell_1k4k.json --plots $W/plots_niah5_1k4k" ;;
    sound2) step sound2 350 "CERTATTN_TIER1=pallas CERTATTN_RUNG0=fused python3 -m pytest -q -n 16 --durations=12 tests/test_soundness.py tests/test_soundness_extreme.py" ;;
    gen_sched2) step gen_sched2 230 "${B/--timeout 150/--timeout 150} --models smollm2 --prompts 1024 --caches dense certified_straight-looped certified_adaptive certified --rung0 fused --out $W/gen_sched.json" ;;
    t1_tests) step t1_tests 220 "python3 -m pytest -q -n 8 tests/test_pallas_tier1.py tests/test_certify_rung0.py tests/test_pallas_selftest.py" ;;
    t1_layouts) step t1_layouts 330 "python3 scripts/probe_tier1_layouts.py --shapes 1x32768,1x131072,8x32768 --out $W/probe_tier1_layouts.json" ;;
    t1_probe2) step t1_probe2 300 "python3 scripts/probe_tier1_layouts.py --shapes 1x32768,1x131072 --ablate 1x32768,1x131072 --layouts planar_values --stages 3,4 --bps 0,1,2 --ablations values_only_planar,no_split_planar,no_value_dot_planar --no-baselines --no-checks --out $W/probe_tier1_values.json" ;;
    rung1_sched4) step rung1_sched4 420 "export JAX_PLATFORMS=cuda,cpu; R='python3 scripts/probe_rung1.py --length 2048 --steps 64 --samples 1 --hot-slots 16'; for r0 in fused jnp; do for sc in looped adaptive; do CERTATTN_RUNG0=\$r0 \$R --schedule \$sc --out $W/rung1_16_\${sc}_\${r0}.json; done; done" ;;
    gen_auto_sched) step gen_auto_sched 230 "${B/--timeout 150/--timeout 100} --models smollm2 --prompts 1024 4096 --caches dense certified_adaptive --rung0 auto --out $W/gen_auto_sched.json" ;;
    rung1_ad) step rung1_ad 230 "export JAX_PLATFORMS=cuda,cpu; R='python3 scripts/probe_rung1.py --length 2048 --steps 64 --samples 1 --hot-slots 16'; for sc in adaptive looped; do CERTATTN_RUNG0=fused \$R --schedule \$sc --out $W/rung1_16_\${sc}_fused_b.json; done" ;;
    gen_sched_hlo) step gen_sched_hlo 230 "${B/--timeout 150/--timeout 150} --models smollm2 --prompts 1024 --caches dense certified_adaptive certified --rung0 fused --dump-hlo $W/hlo --out $W/gen_sched_hlo.json" ;;
    ppl8k_naive) step ppl8k_naive 240 "export JAX_PLATFORMS=cuda,cpu; python3 -m certattn_jax eval ppl --lengths 8192 --samples 48 --ppl-steps 256 --cache dense,naive --no-audit --out $W/eval_h200_ppl_8k_12k_tokens_naive.json" ;;
    gen_grid_smol) step gen_grid_smol 300 "python3 scripts/bench_generate.py --timeout 120 --new-tokens 64 --models smollm2 --prompts 1024 4096 --caches dense naive certified certified_adaptive --out $W/gen_grid_smol.json" ;;
    gen_grid_8b32k) step gen_grid_8b32k 330 "python3 scripts/bench_generate.py --timeout 150 --new-tokens 64 --models llama3.1-8b --prompts 32768 --caches dense naive certified --out $W/gen_grid_8b32k.json" ;;
    gen_grid_smol1k) step gen_grid_smol1k 200 "python3 scripts/bench_generate.py --timeout 100 --new-tokens 64 --models smollm2 --prompts 1024 --caches dense naive certified certified_adaptive --out $W/gen_grid_smol1k.json" ;;
    sched_rand)  # looped with stacked weights (the new default for small layers) vs the weight switch, vs adaptive;
      # eps 0.01 sends ~14 % of random-weight head-steps to rung 1 on the H200 (every step leaves rung 0), as real text does
      step sched_rand 230 "$B --models smollm2 --prompts 1024 --caches dense certified certified_adaptive --out $W/sched_rand.json"
      step sched_rand_eps 160 "$B --models smollm2 --prompts 1024 --caches certified certified_adaptive --eps 0.01 --out $W/sched_rand_eps01.json"
      step sched_rand_switch 160 "CERTATTN_LOOPED_WEIGHTS=switch $B --models smollm2 --prompts 1024 --caches certified certified_adaptive --eps 0.01 --out $W/sched_rand_switch_eps01.json"
      step sched_rand_switch0 90 "CERTATTN_LOOPED_WEIGHTS=switch $B --models smollm2 --prompts 1024 --caches certified --out $W/sched_rand_switch.json" ;;
    sched_real)  # real text (the GGUF assembled first): looped stacked / switch, adaptive stacked
      step sched_real 300 "export JAX_PLATFORMS=cuda,cpu; R='python3 scripts/probe_rung1.py --length 2048 --steps 64 --samples 1 --hot-slots 16'; \$R --schedule looped --out $W/real_looped_stacked.json && CERTATTN_LOOPED_WEIGHTS=switch \$R --schedule looped --out $W/real_looped_switch.json && \$R --schedule adaptive --out $W/real_adaptive_stacked.json" ;;
    trace_eps) step trace_eps 240 "python3 scripts/trace_decode.py --model smollm2 --prompt 1024 --eps 0.01 --caches certified certified_adaptive --steps 16 --out $W/trace_eps01.json" ;;
    trace_def) step trace_def 240 "python3 scripts/trace_decode.py --model smollm2 --prompt 1024 --caches dense certified certified_adaptive --steps 16 --out $W/trace_default.json" ;;
    cb_probe)  # issue 7: the looped body's per-iteration host cost (one command buffer launch per layer-step, traced)
      C="python3 scripts/bench_generate.py --timeout 120 --new-tokens 64 --models smollm2 --prompts 1024"
      CB=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN
      step cb_default 150 "$C --caches dense certified --out $W/cb_default.json"
      # (2 and 3 layers per loop iteration ran here on 2026-12-02 with a CERTATTN_LAYER_UNROLL knob, since removed)
      step cb_nodsf 120 "XLA_FLAGS=--xla_gpu_enable_command_buffer=$CB $C --caches certified --out $W/cb_nodsf.json"
      step cb_while_unroll 150 "XLA_FLAGS='--xla_gpu_enable_command_buffer=$CB,DYNAMIC_SLICE_FUSION,WHILE,CONDITIONAL --xla_gpu_command_buffer_unroll_loops=true' $C --caches dense certified --out $W/cb_while_unroll.json"
      step cb_while 150 "XLA_FLAGS=--xla_gpu_enable_command_buffer=$CB,DYNAMIC_SLICE_FUSION,WHILE,CONDITIONAL $C --caches certified --out $W/cb_while.json" ;;
    streak)  # issue 7: adaptive with a rung-0 streak before its rung-0 pass (1 = the old rule) vs looped, random weights
      C="python3 scripts/bench_generate.py --timeout 120 --new-tokens 64 --models smollm2 --prompts 1024"
      step streak_def 200 "$C --caches dense certified certified_adaptive --out $W/streak4_default.json"
      step streak_eps 150 "$C --caches certified certified_adaptive --eps 0.01 --out $W/streak4_eps01.json"
      step streak1_eps 100 "CERTATTN_ADAPTIVE_STREAK=1 $C --caches certified_adaptive --eps 0.01 --out $W/streak1_eps01.json"
      step streak16_eps 100 "CERTATTN_ADAPTIVE_STREAK=16 $C --caches certified_adaptive --eps 0.01 --out $W/streak16_eps01.json"
      step streak16_def 100 "CERTATTN_ADAPTIVE_STREAK=16 $C --caches certified_adaptive --out $W/streak16_default.json" ;;
    streak_real)  # real text (the GGUF assembled first): looped vs adaptive (streak 4, and 1 = the old rule)
      step streak_real 330 "export JAX_PLATFORMS=cuda,cpu; R='python3 scripts/probe_rung1.py --length 2048 --steps 64 --samples 1 --hot-slots 16'; \$R --schedule adaptive --out $W/real_adaptive_streak4.json && \$R --schedule looped --out $W/real_looped.json && CERTATTN_ADAPTIVE_STREAK=1 \$R --schedule adaptive --out $W/real_adaptive_streak1.json" ;;
    grid_auto)  # issue 7's rows with the "auto" schedule (adaptive on the GPU): SmolLM2 1K, 8B 8K (never run), 8B 32K
      G="python3 scripts/bench_generate.py --timeout 170 --new-tokens 64"
      step grid_smol1k 150 "$G --models smollm2 --prompts 1024 --caches dense naive certified --out $W/grid_auto_smol1k.json"
      step grid_8b8k 230 "$G --models llama3.1-8b --prompts 8192 --caches dense naive certified --out $W/grid_auto_8b8k.json"
      step grid_8b32k 200 "$G --models llama3.1-8b --prompts 32768 --caches certified --out $W/grid_auto_8b32k.json" ;;
    ttft_phases) step ttft_phases 120 "python3 scripts/probe_ttft_phases.py --model smollm2 --prompt 1024 --repeats 7 --out $W/probe_ttft_phases_smol1k.json" ;;
    second_pass)  # what the whole ladder's second pass costs per call (its first run in a call) and per step:
      # eps 1e-6 sends every step there; 8 against 64 new tokens separates the per-call cost from the per-step one
      C="python3 scripts/bench_generate.py --timeout 120 --models smollm2 --prompts 1024 --caches certified --eps 1e-6"
      step second_pass8 120 "$C --new-tokens 8 --out $W/second_pass_8.json"
      step second_pass64 120 "$C --new-tokens 64 --out $W/second_pass_64.json" ;;
    cmdbuf_why)  # which thunks of the looped body XLA leaves out of command buffers (why CONDITIONAL changed nothing)
      step cmdbuf_why 200 "TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=command_buffer_conversion_pass=2,command_buffer_thunk=1 XLA_FLAGS=--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION,WHILE,CONDITIONAL python3 scripts/bench_generate.py --timeout 150 --new-tokens 8 --models smollm2 --prompts 1024 --caches certified_looped --out $W/cmdbuf_why.json > $W/cmdbuf_why_vlog.txt 2>&1; grep -c . $W/cmdbuf_why_vlog.txt; grep -i 'unsupported thunk\\|not convertible\\|convert' $W/cmdbuf_why_vlog.txt | sort | uniq -c | sort -rn | head -40 > $W/cmdbuf_why_summary.txt" ;;
    gen_grid_8b) step gen_grid_8b 520 "python3 scripts/bench_generate.py --timeout 170 --new-tokens 64 --models llama3.1-8b --prompts 8192 32768 --caches dense naive certified --out $W/gen_grid_8b.json" ;;
    issue7_h)  # eighth session: a fresh machine with the self-checks started at the prefill; 8B 8K grid rows; planar
      # against interleaved values (compile and speed) at SmolLM2 1K and 8B 8K; the decode compile without autotuning
      G="python3 scripts/bench_generate.py --timeout 150 --new-tokens 64"
      step fresh_smol1k 150 "$G --models smollm2 --prompts 1024 --caches dense certified naive --out $W/fresh_smol1k.json"
      step ab_smol1k 75 "CERTATTN_VALUE_PACKING=interleaved $G --models smollm2 --prompts 1024 --caches certified --out $W/ab_smol1k_interleaved.json"
      step grid_8b8k_h 240 "$G --models llama3.1-8b --prompts 8192 --caches dense naive certified --out $W/grid_8b8k.json"
      step ab_8b8k 100 "CERTATTN_VALUE_PACKING=interleaved $G --models llama3.1-8b --prompts 8192 --caches certified --out $W/ab_8b8k_interleaved.json"
      step autotune_8b8k 90 "XLA_FLAGS=--xla_gpu_autotune_level=0 $G --models llama3.1-8b --prompts 8192 --caches certified --out $W/autotune0_8b8k.json" ;;
    compile_parts)  # issue 7: where the 8B certified compile goes (parts left out; fused against jnp rung 0), and
      # rung 0 fused against jnp end to end where "auto" switches (SmolLM2 4K: 65 blocks; 8B 8K and 32K)
      step compile_parts 300 "python3 scripts/probe_compile_parts.py --model llama3.1-8b --capacity 8256 --modes dense certified --rung0 jnp fused --out $W/probe_compile_parts_8b8k.json"
      step rung0_ab 280 "G='python3 scripts/bench_generate.py --timeout 120 --new-tokens 64 --caches certified'; \$G --models smollm2 --prompts 4096 --rung0 fused --out $W/rung0_fused_smol4k.json && \$G --models llama3.1-8b --prompts 8192 --rung0 fused --out $W/rung0_fused_8b8k.json" ;;
    rung0_warps)  # issue 8: the fused rung 0 at long context with more warps per program (register pressure?)
      for w in 4 8 16; do
        step rung0_warps_$w 150 "CERTATTN_RUNG0_WARPS=$w python3 scripts/profile_cert_step.py --shapes smol:1024 8b:32768 8b:131072 --tier1 pallas fused --phases fast --steps 30 --reps 3 --out $W/rung0_warps_$w.json"
      done ;;
    rung0_v4)  # ninth session: the fused rung 0 in chunked passes (v4): compiled tests, pass width x warps at 512 and
      # 2,048 blocks against the jnp rung 0, then end to end at 8B 8K (fused against jnp: compile and tokens/s)
      step rung0_v4_tests 150 "python3 -m pytest -q -n 8 -x tests/test_certify_rung0.py"
      P="python3 scripts/profile_cert_step.py --phases fast --steps 30 --reps 3 --tier1 pallas fused"
      step rung0_chunks 330 "$P --shapes smol:1024 --rung0-variants 256x4 --out $W/chunks_smol1k.json; $P --shapes 8b:32768 --rung0-variants 64x4 128x4 256x4 512x4 256x8 --out $W/chunks_8b32k.json; $P --shapes 8b:131072 --rung0-variants 128x4 256x4 512x4 2048x4 256x8 --out $W/chunks_8b128k.json"
      step rung0_v4_8b8k 200 "G='python3 scripts/bench_generate.py --timeout 95 --new-tokens 64 --models llama3.1-8b --prompts 8192 --caches certified'; \$G --rung0 fused --out $W/v4_8b8k_fused.json; \$G --rung0 jnp --out $W/v4_8b8k_jnp.json" ;;
    why8b)  # ninth session: where an 8B certified decode step goes (8K: 13 ms against dense 4.9), kernel by kernel;
      # and the attention fast pass at 32K (31 launches around ~65 us of tier-1 pass), traced, HLO dumped
      step why8b_trace 200 "python3 scripts/trace_decode.py --model llama3.1-8b --prompt 8192 --caches certified --steps 16 --out $W/trace_decode_8b8k.json"
      step gen8b8k_looped 110 "python3 scripts/bench_generate.py --timeout 100 --new-tokens 64 --models llama3.1-8b --prompts 8192 --caches certified --out $W/gen8b8k_looped.json"
      step why_fast32k 120 "python3 scripts/profile_cert_step.py --shapes 8b:32768 --tier1 fused --rung0-variants 256x8 --phases fast --steps 30 --reps 3 --trace /tmp/trc --dump-hlo $W/hlo --out $W/why_fast32k.json"
      hlo_analyses ;;
    sched8b)  # ninth session: 8B with "auto" = looped for large layers (the second pass copying weights out of one
      # switch) against "adaptive" by name and dense, one call; HLO dumped (how the GEMVs compile inside the
      # switch branches against dense's unrolled layers); then the 8B 32K compile
      G="python3 scripts/bench_generate.py --timeout 110 --new-tokens 64 --models llama3.1-8b"
      step sched8b8k 260 "$G --prompts 8192 --caches dense certified certified_adaptive --dump-hlo $W/hlo --out $W/sched8b8k.json"
      step sched8b32k 100 "$G --prompts 32768 --caches certified --rung0 fused --out $W/sched8b32k_fused.json" ;;
    sched8b_small)  # the same, within a short budget: each row its own step (each packed when it ends)
      G="python3 scripts/bench_generate.py --timeout 80 --new-tokens 64 --models llama3.1-8b --prompts 8192"
      step s8_certified 80 "$G --caches certified --out $W/s8_certified.json"
      step s8_dense 50 "$G --caches dense --out $W/s8_dense.json"
      step s8_adaptive 80 "$G --caches certified_adaptive --out $W/s8_adaptive.json" ;;
    trace8b) step trace8b 150 "python3 scripts/trace_decode.py --model llama3.1-8b --prompt 8192 --caches certified --steps 16 --out $W/trace_decode_8b8k.json" ;;
    t1_features)  # tenth session: why the fast pass's tier-1 launch is ~2x the plain pass (features one by one, tunings)
      step t1_features 330 "python3 scripts/probe_tier1_features.py --contexts 32768,131072 --out $W/probe_tier1_features.json; python3 scripts/probe_tier1_features.py --contexts 32768 --batch 8 --out $W/probe_tier1_features_b8.json" ;;
    slot_fix)  # tenth session: the slot programs in 16-token chunks; timed with the features that matter, and the
      # fast pass at 32K and 128K (run after t1_tests sound2)
      step slot_fix_features 200 "python3 scripts/probe_tier1_features.py --no-check --contexts 32768,131072 --variants features:plain,features:delta_hot,features:delta_hot_slots,features:full,full:warps4,full:stages3,full:bps8 --out $W/probe_tier1_features_slotfix.json"
      step slot_fix_fast 150 "python3 scripts/profile_cert_step.py --shapes 8b:32768 8b:131072 --tier1 fused --phases fast --steps 30 --reps 3 --out $W/fast_slotfix.json" ;;
    slot_fix_quick) step slot_fix_quick 120 "python3 scripts/probe_tier1_features.py --no-check --reps 3 --contexts 32768,131072 --variants features:delta_hot,features:full,full:warps4,full:stages3 --out $W/probe_tier1_features_slotfix.json" ;;
    sched8b_unrolled)  # tenth session: 8B 8K with the fast pass unrolled (two-pass: rung-1 conditional per layer;
      # straight: none) now that the fused rung 0 makes it small, against auto (looped)
      G="python3 scripts/bench_generate.py --timeout 150 --new-tokens 64 --models llama3.1-8b --prompts 8192"
      step u8_auto 100 "$G --caches dense certified --out $W/u8_auto.json"
      step u8_twopass 160 "$G --caches certified_two-pass --out $W/u8_twopass.json"
      step u8_straight 160 "$G --caches certified_straight --out $W/u8_straight.json"
      # (fifteenth session) "adaptive" for large layers: straight after a rung-0 streak, else looped
      step u8_adaptive 200 "$G --caches certified_adaptive --out $W/u8_adaptive.json" ;;
    fresh8b)  # eleventh session: on a FRESH machine (no kept verdicts): the decode compile overlapped with the kernels'
      # self-checks (kernel_checks.compile_while_checking); compile_s and selftest_s against 36.9 / 16.9 s before
      step fresh8b 200 "python3 scripts/bench_generate.py --timeout 190 --new-tokens 64 --models llama3.1-8b --prompts 8192 --caches certified dense --out $W/fresh8b.json" ;;
    rung0_warps8)  # the certify kernel with 8 warps where it was never timed (SmolLM2 1K/4K) against 4, and at 8B the
      # narrower chunks and 16 warps (its passes look register-bound: wider chunks were slower, more warps faster)
      step rung0_warps8 240 "P='python3 scripts/profile_cert_step.py --phases fast --steps 30 --reps 3 --tier1 fused'; \$P --shapes smol:1024 smol:4096 --rung0-variants 256x4 256x8 --out $W/warps8_smol.json; \$P --shapes 8b:8192 8b:32768 --rung0-variants 256x4 256x8 128x8 64x8 256x16 --out $W/warps8_8b.json" ;;
    fresh8b_32k)  # twelfth session: on a FRESH machine, the certify kernel's per-size warps (8K: 128x8, self-checked on
      # a 195-block case) and the compile's phases (lower_s / xla_compile_s); then 8B 32K with the fused rung 0
      # (auto took jnp there: 520 blocks > the old 512 limit)
      step fresh8b_32k 330 "python3 scripts/bench_generate.py --timeout 190 --new-tokens 64 --models llama3.1-8b --prompts 8192 --caches certified dense --out $W/fresh8b_v2.json; python3 scripts/bench_generate.py --timeout 150 --new-tokens 64 --models llama3.1-8b --prompts 32768 --caches certified --out $W/cert8b32k.json" ;;
    compile8b)  # twelfth session's question: the 8B certified decode's 24 s of XLA compile (dense 5.8) -- each kernel's
      # compile at the 8B shape, then the same decode program without any kernel (tier 1 and rung 0 in XLA)
      step compile8b 330 "python3 scripts/probe_kernel_compile.py --shapes 8b:8192 --k-max 8 --out $W/probe_kernel_compile_8b.json; python3 scripts/bench_generate.py --timeout 190 --new-tokens 16 --models llama3.1-8b --prompts 8192 --caches certified --tier1 jnp --rung0 jnp --out $W/compile_nokernels.json" ;;
    ncu_fast)  # twentieth session: what bounds the fast pass's two launches (Nsight Compute: stall reasons,
      # registers, occupancy, local memory), per shape in a process of its own; a first run without ncu keeps the
      # kernels' self-check verdicts on disk, so the profiled process launches only the measured kernels
      NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -n 1)
      P="python3 scripts/profile_cert_step.py --tier1 fused --phases rung0 --steps 4 --reps 1"
      S="--section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section InstructionStats"
      M="--metrics smsp__sass_inst_executed_op_local_ld.sum,smsp__sass_inst_executed_op_local_st.sum,smsp__inst_executed.sum,smsp__cycles_active.avg"
      for s in smol:1024 8b:8192 8b:32768; do
        n=${s/:/_}
        step ncu_$n 150 "$P --shapes $s --out $W/ncu_plain_$n.json && $NCU --clock-control none -k regex:certattn_ --launch-count 4 $S $M --log-file $W/ncu_$n.txt $P --shapes $s"
      done ;;
    smol_pair) step smol_pair 200 "python3 scripts/bench_generate.py --timeout 100 --new-tokens 64 --models smollm2 --prompts 1024 --caches dense certified --out $W/smol_pair.json" ;;
    sched8b_h100)  # twentieth session: 8B 8K on this machine: dense, the default (looped, a weight switch per layer),
      # adaptive with the stacked-weight kernel (no per-layer conditional on a rung-0 step), one process per row
      G="python3 scripts/bench_generate.py --timeout 130 --new-tokens 64 --models llama3.1-8b --prompts 8192"
      step sched8b_h100 480 "$G --caches dense --out $W/s8_dense.json; $G --caches certified --out $W/s8_looped.json; CERTATTN_LOOPED_WEIGHTS=kernel $G --caches certified_adaptive --out $W/s8_adaptive_kernel.json" ;;
    ab_smol)  # twentieth session: the per-layer-step launches removed (layer rows by dynamic-update-slice, no per-layer
      # escalate / hot_pending / lengths writes, one-pass norms) against the tree before them (.carry_old, carried:
      # git archive 668a581), SmolLM2 1K, one process per row, alternated, dense in the same call; then the model
      # tests whose decode runs through the changed code, compiled
      G="python3 scripts/bench_generate.py --timeout 100 --new-tokens 64 --models smollm2 --prompts 1024"
      step ab_smol 330 "$G --caches dense certified --out $W/ab_new_1.json; (cd .carry_old && PYTHONPATH=. $G --caches certified --out $W/ab_old_1.json); $G --caches certified --out $W/ab_new_2.json; (cd .carry_old && PYTHONPATH=. $G --caches certified --out $W/ab_old_2.json)"
      step ab_tests 150 "python3 -m pytest -q -x -n 8 tests/test_e2e_cache.py -k 'schedules_decode or marks_exactly or end_of_a_step or kernels_read_each_layer or adaptive_schedule_picks'" ;;
    ab_min)  # ab_smol's rows within a short budget: dense and certified now, certified before, certified now again
      G="python3 scripts/bench_generate.py --timeout 80 --new-tokens 64 --models smollm2 --prompts 1024"
      step ab_min 210 "$G --caches dense certified --out $W/ab_new_1.json; (cd .carry_old && PYTHONPATH=. $G --caches certified --out $W/ab_old_1.json); $G --caches certified --out $W/ab_new_2.json" ;;
    wt_tests)  # twenty-first session: the token-write kernel compiled (its tests, its self-check, a model decoding
      # through it against XLA's writes), and the model tests whose decode runs through it
      step wt_tests 150 "python3 -m pytest -q -n 8 tests/test_pallas_write_token.py tests/test_e2e_cache.py -k 'write or marks_exactly or end_of_a_step or one_conditional'" ;;
    ab3)  # twenty-first session: SmolLM2 1K certified in three trees, one process per row, alternated: now (the
      # token-write kernel), .carry_mid (git archive e1db875: the twentieth session's XLA launch cuts), .carry_old
      # (git archive 668a581: before both); dense in the same call
      G="python3 scripts/bench_generate.py --timeout 80 --new-tokens 64 --models smollm2 --prompts 1024"
      step ab3 330 "$G --caches dense certified --out $W/ab3_now_1.json; (cd .carry_mid && PYTHONPATH=. $G --caches certified --out $W/ab3_mid_1.json); (cd .carry_old && PYTHONPATH=. $G --caches certified --out $W/ab3_old_1.json); $G --caches certified --out $W/ab3_now_2.json; (cd .carry_mid && PYTHONPATH=. $G --caches certified --out $W/ab3_mid_2.json)" ;;
    sched_xla)  # twenty-first session: does the layer-schedules test's bound tolerance (1e-6 across programs) hold on a
      # GPU with XLA's token writes? (it failed with the write kernel; never run on a GPU before)
      step sched_xla 150 "CERTATTN_WRITE_KERNEL=0 python3 -m pytest -q -x tests/test_e2e_cache.py -k 'schedules_decode_identically and rung0'" ;;
    ab_k1)  # twenty-first session: SmolLM2 1K certified, now (value statistics kept by the writes) against .carry_k1
      # (git archive 4c31ca1: the token-write kernel alone), alternated, dense in the same call
      G="python3 scripts/bench_generate.py --timeout 80 --new-tokens 64 --models smollm2 --prompts 1024"
      step ab_k1 300 "$G --caches dense certified --out $W/abk1_now_1.json; (cd .carry_k1 && PYTHONPATH=. $G --caches certified --out $W/abk1_k1_1.json); $G --caches certified --out $W/abk1_now_2.json; (cd .carry_k1 && PYTHONPATH=. $G --caches certified --out $W/abk1_k1_2.json)" ;;
    ab_three)  # twenty-first session: SmolLM2 1K certified: now (+ one conditional for the second pass and the end of
      # the step), .carry_vs (git archive 81114fe: + the value statistics), .carry_k1 (4c31ca1: the token-write kernel)
      G="python3 scripts/bench_generate.py --timeout 80 --new-tokens 64 --models smollm2 --prompts 1024"
      step ab_three 240 "$G --caches dense certified --out $W/ab_now_1.json; (cd .carry_k1 && PYTHONPATH=. $G --caches certified --out $W/ab_k1_1.json); (cd .carry_vs && PYTHONPATH=. $G --caches certified --out $W/ab_vs_1.json); $G --caches certified --out $W/ab_now_2.json" ;;
    ab_k1_short) G="python3 scripts/bench_generate.py --timeout 80 --new-tokens 64 --models smollm2 --prompts 1024"
      step ab_k1_short 200 "$G --caches dense certified --out $W/abk1_now_1.json; (cd .carry_k1 && PYTHONPATH=. $G --caches certified --out $W/abk1_k1_1.json); $G --caches certified --out $W/abk1_now_2.json" ;;
    ab22)  # twenty-second session: SmolLM2 1K certified, now (K* in the certify kernel, the block value errors in it,
      # the rung-0 output that does not wait for the bound) against .carry_k1 (git archive be2482a: the twenty-first
      # session's measured tree), and dense / now with concurrent command-buffer scheduling (independent launches
      # may overlap); dense in the call
      G="python3 scripts/bench_generate.py --timeout 80 --new-tokens 64 --models smollm2 --prompts 1024"
      step ab22 260 "$G --caches dense certified --out $W/ab22_now_1.json; (cd .carry_k1 && PYTHONPATH=. $G --caches certified --out $W/ab22_k1_1.json); XLA_FLAGS=--xla_gpu_command_buffer_scheduling_mode=CONCURRENT $G --caches dense certified --out $W/ab22_now_concurrent.json; $G --caches certified --out $W/ab22_now_2.json" ;;
    ab22_split)  # ab22's rows as steps of their own (each packed when it ends: a call cut short keeps the rows done)
      G="python3 scripts/bench_generate.py --timeout 80 --new-tokens 64 --models smollm2 --prompts 1024"
      step ab22_now1 70 "$G --caches dense certified --out $W/ab22_now_1.json"
      step ab22_k1 50 "cd .carry_k1 && PYTHONPATH=. $G --caches certified --out $W/ab22_k1_1.json"
      step ab22_conc 70 "XLA_FLAGS=--xla_gpu_command_buffer_scheduling_mode=CONCURRENT $G --caches dense certified --out $W/ab22_now_concurrent.json"
      step ab22_now2 50 "$G --caches certified --out $W/ab22_now_2.json" ;;
    ab_nested)  # twenty-second session: SmolLM2 1K certified, plain vs nested decode loop (one host round trip per
      # common step instead of three), dense in the same call; each row its own step
      G="python3 scripts/bench_generate.py --timeout 80 --new-tokens 64 --models smollm2 --prompts 1024"
      step abn_plain 70 "$G --caches dense certified --out $W/abn_plain_1.json"
      step abn_nested 50 "CERTATTN_DECODE_LOOP_NESTED=1 $G --caches certified --out $W/abn_nested_1.json"
      step abn_plain2 50 "$G --caches certified --out $W/abn_plain_2.json"
      step abn_nested2 50 "CERTATTN_DECODE_LOOP_NESTED=1 $G --caches certified --out $W/abn_nested_2.json" ;;
    nested8b)  # twenty-second session: 8B 8K, adaptive with the stacked-weight kernel (no per-layer conditional),
      # plain vs nested decode loop (1 host round trip per common step), dense in the call; each row its own step
      G="python3 scripts/bench_generate.py --timeout 130 --new-tokens 64 --models llama3.1-8b --prompts 8192"
      step n8_dense 150 "$G --caches dense --out $W/n8_dense.json"
      step n8_plain 150 "CERTATTN_LOOPED_WEIGHTS=kernel $G --caches certified_adaptive --out $W/n8_plain.json"
      step n8_nested 150 "CERTATTN_LOOPED_WEIGHTS=kernel CERTATTN_DECODE_LOOP_NESTED=1 $G --caches certified_adaptive --out $W/n8_nested.json" ;;
    ab_conc)  # twenty-third session: SmolLM2 1K, the decode loop's command buffers CONCURRENT (the default now) against
      # SERIALIZE (XLA's default), alternated, dense and certified; each row its own step
      G="python3 scripts/bench_generate.py --timeout 80 --new-tokens 64 --models smollm2 --prompts 1024"
      step abc_conc1 70 "$G --caches dense certified --out $W/abc_conc_1.json"
      step abc_ser1 70 "CERTATTN_COMMAND_BUFFER_SCHEDULING=SERIALIZE $G --caches dense certified --out $W/abc_ser_1.json"
      step abc_conc2 50 "$G --caches certified --out $W/abc_conc_2.json"
      step abc_ser2 50 "CERTATTN_COMMAND_BUFFER_SCHEDULING=SERIALIZE $G --caches certified --out $W/abc_ser_2.json" ;;
    ab_warps)  # twenty-third session: the certify kernel's warps at SmolLM2's 16 / 64 block columns (the 2026-12-04b
      # phase timings had 1-2 warps ~7 us per layer faster than the default 4, within a noisy spread), alternated
      G="python3 scripts/bench_generate.py --timeout 80 --new-tokens 64 --models smollm2"
      step abw_def1 70 "$G --prompts 1024 --caches dense certified --out $W/abw_def_1.json"
      step abw_w1_1 50 "CERTATTN_RUNG0_WARPS=1 $G --prompts 1024 --caches certified --out $W/abw_w1_1.json"
      step abw_w2_1 50 "CERTATTN_RUNG0_WARPS=2 $G --prompts 1024 --caches certified --out $W/abw_w2_1.json"
      step abw_def2 50 "$G --prompts 1024 --caches certified --out $W/abw_def_2.json"
      step abw_w1_2 50 "CERTATTN_RUNG0_WARPS=1 $G --prompts 1024 --caches certified --out $W/abw_w1_2.json"
      step abw_w2_2 50 "CERTATTN_RUNG0_WARPS=2 $G --prompts 1024 --caches certified --out $W/abw_w2_2.json"
      step abw_def4k 80 "$G --prompts 4096 --caches dense certified --out $W/abw_def_4k.json"
      step abw_w1_4k 60 "CERTATTN_RUNG0_WARPS=1 $G --prompts 4096 --caches certified --out $W/abw_w1_4k.json" ;;
    ab_bps)  # twenty-third session: SmolLM2's fast pass keeps 1 block per split (48 / 192 programs at 1K / 4K); 2 and 4
      # blocks per split (fewer split accumulators for the certify kernel to merge), alternated, dense in the call
      G="python3 scripts/bench_generate.py --timeout 80 --new-tokens 64 --models smollm2"
      step abb_4k_def1 70 "$G --prompts 4096 --caches dense certified --out $W/abb_4k_def_1.json"
      step abb_4k_b4_1 45 "CERTATTN_TIER1_BPS=4 $G --prompts 4096 --caches certified --out $W/abb_4k_b4_1.json"
      step abb_4k_b2_1 45 "CERTATTN_TIER1_BPS=2 $G --prompts 4096 --caches certified --out $W/abb_4k_b2_1.json"
      step abb_1k_b4_1 45 "CERTATTN_TIER1_BPS=4 $G --prompts 1024 --caches certified --out $W/abb_1k_b4_1.json"
      step abb_1k_def1 55 "$G --prompts 1024 --caches dense certified --out $W/abb_1k_def_1.json"
      step abb_4k_def2 45 "$G --prompts 4096 --caches certified --out $W/abb_4k_def_2.json"
      step abb_4k_b4_2 45 "CERTATTN_TIER1_BPS=4 $G --prompts 4096 --caches certified --out $W/abb_4k_b4_2.json"
      step abb_1k_b2_1 45 "CERTATTN_TIER1_BPS=2 $G --prompts 1024 --caches certified --out $W/abb_1k_b2_1.json" ;;
    ab_bps_confirm)  # twenty-fourth session: confirm the split rule's SmolLM2 4K choice (2 blocks per split, the
      # default since the twenty-third session, one sample then) against 1, alternated, dense in the call
      G="python3 scripts/bench_generate.py --timeout 80 --new-tokens 64 --models smollm2"
      step abbc_4k_def1 70 "$G --prompts 4096 --caches dense certified --out $W/abbc_4k_def_1.json"
      step abbc_4k_b1_1 45 "CERTATTN_TIER1_BPS=1 $G --prompts 4096 --caches certified --out $W/abbc_4k_b1_1.json"
      step abbc_4k_def2 45 "$G --prompts 4096 --caches certified --out $W/abbc_4k_def_2.json"
      step abbc_4k_b1_2 45 "CERTATTN_TIER1_BPS=1 $G --prompts 4096 --caches certified --out $W/abbc_4k_b1_2.json"
      step abbc_1k_def1 55 "$G --prompts 1024 --caches dense certified --out $W/abbc_1k_def_1.json" ;;
    prof_smol)  # where SmolLM2 4K's extra time goes (certified / dense 0.52-0.56x at 4K, 0.77x at 1K): one layer's
      # phases at 1K and 4K, device-timed, with the launch counts, dense and naive in the same run
      step prof_smol 200 "python3 scripts/profile_cert_step.py --shapes smol:1024 smol:4096 --tier1 fused --phases tier1 rung0 fast --steps 30 --reps 3 --out $W/prof_smol.json" ;;
    ab_condcb)  # twenty-fourth session: with concurrent command buffers (the default now), do conditionals and loops
      # inside CUDA graphs (no host round trip to pick a branch) pay? 2026-12-01 (serial graphs, older step): no gain.
      # SmolLM2 1K certified: default, +CONDITIONAL,+WHILE, and the nested loop with them; alternated
      G="python3 scripts/bench_generate.py --timeout 80 --new-tokens 64 --models smollm2 --prompts 1024"
      CB="XLA_FLAGS=--xla_gpu_enable_command_buffer=+CONDITIONAL,+WHILE"
      step abcb_def1 60 "$G --caches dense certified --out $W/abcb_def_1.json"
      step abcb_cb1 50 "$CB $G --caches dense certified --out $W/abcb_cb_1.json"
      step abcb_cbn1 50 "$CB CERTATTN_DECODE_LOOP_NESTED=1 $G --caches certified --out $W/abcb_cbn_1.json"
      step abcb_def2 45 "$G --caches certified --out $W/abcb_def_2.json"
      step abcb_cb2 45 "$CB $G --caches certified --out $W/abcb_cb_2.json" ;;
    trace_cb)  # twenty-fourth session: does the host still read a predicate back per conditional when conditionals
      # and loops are allowed into the (concurrent) command buffers? The device's copies per step, traced, both ways
      T="python3 scripts/trace_decode.py --model smollm2 --prompt 1024 --caches dense certified --steps 16"
      step trace_cb_def 110 "$T --out $W/trace_cb_def.json"
      step trace_cb_on 110 "XLA_FLAGS=--xla_gpu_enable_command_buffer=+CONDITIONAL,+WHILE $T --out $W/trace_cb_on.json" ;;
    ab_unroll)  # twenty-fifth session: layers per iteration of the rung-0 pass's loop (CERTATTN_LAYER_UNROLL). The
      # twenty-fourth session's trace: 31.9 host-driven command-buffer launches per certified step (one per layer
      # iteration) against dense's 1, with the device busy 0.66 of ~1.9 ms. SmolLM2 1K certified, alternated
      G="python3 scripts/bench_generate.py --timeout 80 --new-tokens 64 --models smollm2 --prompts 1024"
      step abu_1_1 85 "$G --caches dense certified --out $W/abu_1_1.json"
      step abu_2_1 70 "CERTATTN_LAYER_UNROLL=2 $G --caches certified --out $W/abu_2_1.json"
      step abu_5_1 75 "CERTATTN_LAYER_UNROLL=5 $G --caches certified --out $W/abu_5_1.json"
      step abu_15_1 95 "CERTATTN_LAYER_UNROLL=15 $G --caches certified --out $W/abu_15_1.json"
      step abu_1_2 65 "$G --caches certified --out $W/abu_1_2.json"
      step abu_5_2 75 "CERTATTN_LAYER_UNROLL=5 $G --caches certified --out $W/abu_5_2.json" ;;
    smol4k)  # twenty-fifth session: SmolLM2 4K dense and certified after the in-place hot ids (two rows each, orders swapped)
      G="python3 scripts/bench_generate.py --timeout 80 --new-tokens 64 --models smollm2 --prompts 4096"
      step s4k_1 95 "$G --caches dense certified --out $W/s4k_1.json"
      step s4k_2 95 "$G --caches certified dense --out $W/s4k_2.json" ;;
    hot_used)  # twenty-fifth session: the LRU record of the hot slots updated for every layer at once (the last slice
      # pair of the rung-0 loop body): does +CONDITIONAL,+WHILE now take the layer loop into one graph (trace), and
      # what it gives end to end, default flags and with them, SmolLM2 1K
      F="--xla_gpu_enable_command_buffer=+CONDITIONAL,+WHILE"
      G="python3 scripts/bench_generate.py --timeout 80 --new-tokens 64 --models smollm2 --prompts 1024"
      step hu_trace_on 110 "XLA_FLAGS=$F python3 scripts/trace_decode.py --model smollm2 --prompt 1024 --caches certified --steps 16 --out $W/hu_trace_on.json"
      step hu_1k 95 "$G --caches dense certified --out $W/hu_1k.json"
      step hu_1k_cb 80 "XLA_FLAGS=$F $G --caches certified dense --out $W/hu_1k_cb.json" ;;
    ab_hot_used)  # twenty-sixth session: CERTATTN_HOT_USED_STACKED off / on, default command buffers and
      # +CONDITIONAL,+WHILE, alternated in one call (SmolLM2 1K; dense in the first and last rows)
      F="--xla_gpu_enable_command_buffer=+CONDITIONAL,+WHILE"
      G="python3 scripts/bench_generate.py --timeout 80 --new-tokens 64 --models smollm2 --prompts 1024"
      step ahu_off_1 95 "$G --caches dense certified --out $W/ahu_off_1.json"
      step ahu_on_1 80 "CERTATTN_HOT_USED_STACKED=1 $G --caches certified --out $W/ahu_on_1.json"
      step ahu_cb_off_1 80 "XLA_FLAGS=$F $G --caches certified --out $W/ahu_cb_off_1.json"
      step ahu_cb_on_1 80 "XLA_FLAGS=$F CERTATTN_HOT_USED_STACKED=1 $G --caches certified --out $W/ahu_cb_on_1.json"
      step ahu_on_2 80 "CERTATTN_HOT_USED_STACKED=1 $G --caches certified --out $W/ahu_on_2.json"
      step ahu_off_2 80 "$G --caches certified --out $W/ahu_off_2.json"
      step ahu_cb_on_2 80 "XLA_FLAGS=$F CERTATTN_HOT_USED_STACKED=1 $G --caches certified dense --out $W/ahu_cb_on_2.json"
      step ahu_cb_off_2 80 "XLA_FLAGS=$F $G --caches certified --out $W/ahu_cb_off_2.json" ;;
    ab_nest_cb)  # twenty-seventh session: the nested decode loop (an inner loop of rung-0 first passes, no
      # conditional in its body) with the stacked LRU record (no loop-dependent slice in the layer loop) and
      # +CONDITIONAL,+WHILE: can the whole common-step loop become one CUDA graph, as dense's does (0 predicate
      # reads per step)? SmolLM2 1K and 4K against the defaults, dense in the same processes (anc_trace traces it);
      # anc_1k_opt asks for the graphs through the product's option (the decode loop only) instead of XLA_FLAGS
      F="--xla_gpu_enable_command_buffer=+CONDITIONAL,+WHILE"
      NS="CERTATTN_DECODE_LOOP_NESTED=1 CERTATTN_HOT_USED_STACKED=1"
      G="python3 scripts/bench_generate.py --timeout 80 --new-tokens 64 --models smollm2"
      step anc_1k_def 95 "$G --prompts 1024 --caches dense certified --out $W/anc_1k_def.json"
      step anc_1k_ncb 95 "XLA_FLAGS=$F $NS $G --prompts 1024 --caches certified dense --out $W/anc_1k_ncb.json"
      step anc_1k_opt 80 "CERTATTN_DECODE_CONTROL_FLOW_GRAPHS=1 $NS $G --prompts 1024 --caches certified --out $W/anc_1k_opt.json"
      step anc_4k_def 95 "$G --prompts 4096 --caches dense certified --out $W/anc_4k_def.json"
      step anc_4k_ncb 95 "XLA_FLAGS=$F $NS $G --prompts 4096 --caches certified dense --out $W/anc_4k_ncb.json" ;;
    anc_trace)  # ab_nest_cb's configuration traced: predicate reads and host graph launches per step
      F="--xla_gpu_enable_command_buffer=+CONDITIONAL,+WHILE"
      NS="CERTATTN_DECODE_LOOP_NESTED=1 CERTATTN_HOT_USED_STACKED=1"
      step anc_trace 110 "XLA_FLAGS=$F $NS python3 scripts/trace_decode.py --model smollm2 --prompt 1024 --caches certified --steps 16 --out $W/anc_trace.json" ;;
    host_write)  # twenty-sixth session: can a kernel write tier 2 in pinned host memory in place (the flush's write;
      # the last host transfer of the rare-step conditional that keeps a decode step's predicate reads)? Then the
      # write inside a conditional, with and without conditionals in the command buffers
      P="python3 scripts/probe_host_write.py"
      step host_write 120 "$P --out $W/probe_host_write.json && $P --in-cond --mib 64 --out $W/probe_host_write_cond.json && XLA_FLAGS=--xla_gpu_enable_command_buffer=+CONDITIONAL,+WHILE $P --in-cond --mib 64 --out $W/probe_host_write_cond_cb.json" ;;
    at8b)  # twenty-sixth session: which GEMM fusions the 8B certified decode compile autotunes that dense does not
      # (~10 s of its XLA compile is autotuning, 2026-12-04); dense and certified each in a process of its own,
      # XLA's autotune results dumped after each compile (prefill programs included in both)
      for c in dense certified; do
        step at8b_$c 200 "XLA_FLAGS=--xla_gpu_dump_autotune_results_to=$W/autotune_8b_$c.textproto $B --new-tokens 16 --models llama3.1-8b --prompts 8192 --caches $c --out $W/at8b_$c.json"
      done ;;
    ab_fat)  # twenty-sixth session: XLA's fusion autotuner off (the new default on a GPU, certattn_jax.xla_options)
      # against on, for the decode loop and the kernel self-checks: compile seconds and tokens/s, 8B 8K and SmolLM2
      # 1K, dense and certified, every process checking its kernels afresh (no verdicts kept), alternated
      G8="CERTATTN_SELFTEST_CACHE=off $B --new-tokens 32 --models llama3.1-8b --prompts 8192"
      GS="CERTATTN_SELFTEST_CACHE=off ${B/--timeout 150/--timeout 90} --new-tokens 64 --models smollm2 --prompts 1024"
      step fat8_off $((60 + 70)) "$G8 --caches dense certified --out $W/fat8_off.json"
      step fat8_on 130 "CERTATTN_FUSION_AUTOTUNER=1 $G8 --caches certified dense --out $W/fat8_on.json"
      step fats_off 130 "$GS --caches dense certified --out $W/fats_off.json"
      step fats_on 130 "CERTATTN_FUSION_AUTOTUNER=1 $GS --caches certified dense --out $W/fats_on.json" ;;
    ab_fat_short)  # the same with the SmolLM2 pair certified only (a short device budget)
      G8="CERTATTN_SELFTEST_CACHE=off $B --new-tokens 32 --models llama3.1-8b --prompts 8192"
      GS="CERTATTN_SELFTEST_CACHE=off ${B/--timeout 150/--timeout 90} --new-tokens 64 --models smollm2 --prompts 1024"
      step fat8_off 130 "$G8 --caches dense certified --out $W/fat8_off.json"
      step fat8_on 130 "CERTATTN_FUSION_AUTOTUNER=1 $G8 --caches certified dense --out $W/fat8_on.json"
      step fats_off 70 "$GS --caches certified --out $W/fats_off.json"
      step fats_on 70 "CERTATTN_FUSION_AUTOTUNER=1 $GS --caches certified --out $W/fats_on.json" ;;
    ab_checks_at)  # twenty-sixth session (CPU-built, not yet run): the kernel self-checks compiled without autotuning
      # (the default now, certattn_jax.xla_options.checks_autotune_off) against with it (CERTATTN_CHECKS_AUTOTUNE=1):
      # the fused rung 0 check's seconds (call 1: 36 s) and the 8B certified compile; every process checks afresh
      G8="CERTATTN_SELFTEST_CACHE=off $B --new-tokens 32 --models llama3.1-8b --prompts 8192 --caches certified"
      step cat_dense 110 "${G8/--caches certified/--caches dense} --out $W/cat_dense.json"
      step cat_off_1 110 "$G8 --out $W/cat_off_1.json"
      step cat_on_1 110 "CERTATTN_CHECKS_AUTOTUNE=1 $G8 --out $W/cat_on_1.json"
      step cat_off_2 110 "$G8 --out $W/cat_off_2.json"
      step cat_on_2 110 "CERTATTN_CHECKS_AUTOTUNE=1 $G8 --out $W/cat_on_2.json" ;;
    mm_tests) step mm_tests 90 "python3 -m pytest -q -x tests/test_pallas_stacked_matmul.py" ;;  # compiled
    ab_fat8)  # twenty-seventh session: with the checks compiled without autotuning (the default since the A/B
      # ab_checks_at), XLA's fusion autotuner off for the decode loop (CERTATTN_FUSION_AUTOTUNER=0) against XLA's
      # setting: 8B 8K certified compile (19.2-19.5 s against dense 4.3 s: target 18.6) and speed (SmolLM2 1K:
      # ab_fats); every process checks its kernels afresh; dense in the first row; alternated
      G8="CERTATTN_SELFTEST_CACHE=off $B --new-tokens 32 --models llama3.1-8b --prompts 8192"
      step fat2_8_dense 60 "$G8 --caches dense --out $W/fat2_8_dense.json"
      step fat2_8_off_1 80 "CERTATTN_FUSION_AUTOTUNER=0 $G8 --caches certified --out $W/fat2_8_off_1.json"
      step fat2_8_xla_1 80 "$G8 --caches certified --out $W/fat2_8_xla_1.json"
      step fat2_8_off_2 80 "CERTATTN_FUSION_AUTOTUNER=0 $G8 --caches certified --out $W/fat2_8_off_2.json"
      step fat2_8_xla_2 80 "$G8 --caches certified --out $W/fat2_8_xla_2.json" ;;
    ab_fat8_short)  # ab_fat8 with one row each (a short device budget)
      G8="CERTATTN_SELFTEST_CACHE=off $B --new-tokens 32 --models llama3.1-8b --prompts 8192"
      step fat2_8_dense 60 "$G8 --caches dense --out $W/fat2_8_dense.json"
      step fat2_8_off_1 80 "CERTATTN_FUSION_AUTOTUNER=0 $G8 --caches certified --out $W/fat2_8_off_1.json"
      step fat2_8_xla_1 80 "$G8 --caches certified --out $W/fat2_8_xla_1.json" ;;
    bridge8b)  # twenty-eighth session: the decode bridge (models.generate.decode_bridge: decoding waits only for the
      # rung-0 first-pass program, the whole loop compiles beside it) on / off, alternated, 8B 8K, dense in the call;
      # every process checks its kernels afresh (also this session's one-way fused check: picks); then SmolLM2 1K /
      # 4K with the bridge (the warm run's speed must be the whole loop's, as before)
      G8="CERTATTN_SELFTEST_CACHE=off $B --new-tokens 32 --models llama3.1-8b --prompts 8192"
      step b8_dense 70 "$G8 --caches dense --out $W/b8_dense.json"
      step b8_on 80 "$G8 --caches certified --out $W/b8_on.json"
      step b8_off 80 "CERTATTN_DECODE_BRIDGE=0 $G8 --caches certified --out $W/b8_off.json"
      step b8_on2 80 "$G8 --caches certified --out $W/b8_on2.json"
      step bs_smol 170 "${B/--timeout 150/--timeout 80} --new-tokens 64 --models smollm2 --prompts 1024 4096 --caches dense certified --out $W/bs_smol.json" ;;
    bridge_diag)  # for the twenty-ninth session: why the non-steady bridge's whole program decodes 13-26 % slower
      # than the one program (twenty-eighth session): the one program, the whole program built in the background,
      # the whole program built in the decoding thread, SmolLM2 1K, each with its HLO dumped (compare the loop bodies)
      S="${B/--timeout 150/--timeout 70} --new-tokens 64 --models smollm2 --prompts 1024 --caches certified"
      step bd_one 60 "CERTATTN_DECODE_BRIDGE=0 $S --dump-hlo $W/hlo/one --out $W/bd_one.json"
      step bd_bg 60 "CERTATTN_DECODE_BRIDGE_STEADY=0 $S --dump-hlo $W/hlo/bg --out $W/bd_bg.json"
      step bd_fg 60 "CERTATTN_DECODE_BRIDGE_STEADY=0 CERTATTN_DECODE_BRIDGE_BACKGROUND=0 $S --dump-hlo $W/hlo/fg --out $W/bd_fg.json"
      hlo_analyses ;;
    bridge3)  # twenty-eighth session: the steady bridge as the default (first passes the loop, the whole program
      # only for runs of steps that leave rung 0) against no bridge, alternated per model, dense in the call; 8B
      # with its per-layer switches (default weights) and with the stacked-weight kernel
      G8="CERTATTN_SELFTEST_CACHE=off $B --new-tokens 32 --models llama3.1-8b --prompts 8192"
      S="${B/--timeout 150/--timeout 70} --new-tokens 64 --models smollm2"
      step d_1k 110 "$S --prompts 1024 --caches dense certified --out $W/d_on_1k.json; CERTATTN_DECODE_BRIDGE=0 $S --prompts 1024 --caches certified --out $W/d_off_1k.json"
      step d_4k 110 "CERTATTN_DECODE_BRIDGE=0 $S --prompts 4096 --caches dense certified --out $W/d_off_4k.json; $S --prompts 4096 --caches certified --out $W/d_on_4k.json"
      step d8_on 75 "$G8 --caches certified --out $W/d8_on.json"
      step d8_off 75 "CERTATTN_DECODE_BRIDGE=0 $G8 --caches dense certified --out $W/d8_off.json"
      step d8_kernel 75 "CERTATTN_LOOPED_WEIGHTS=kernel $G8 --caches certified --out $W/d8_kernel.json" ;;
    bridge2)  # twenty-eighth session, after bridge8b (the whole loop 13-20 % slower with the bridge: both programs
      # autotuned at once): the bridge's first passes compiled untuned. Bridge on / off alternated, 8B 8K and
      # SmolLM2 1K / 4K, dense in the call; then the first passes as the steady loop (SmolLM2 1K, 8B with the
      # stacked-weight kernel: no per-layer conditional)
      G8="CERTATTN_SELFTEST_CACHE=off $B --new-tokens 32 --models llama3.1-8b --prompts 8192"
      S="${B/--timeout 150/--timeout 70} --new-tokens 64 --models smollm2"
      step c8_dense 50 "$G8 --caches dense --out $W/c8_dense.json"
      step c8_on 75 "$G8 --caches certified --out $W/c8_on.json"
      step c8_off 75 "CERTATTN_DECODE_BRIDGE=0 $G8 --caches certified --out $W/c8_off.json"
      step c8_on2 75 "$G8 --caches certified --out $W/c8_on2.json"
      step cs_1k 110 "$S --prompts 1024 --caches dense certified --out $W/cs_on_1k.json; CERTATTN_DECODE_BRIDGE=0 $S --prompts 1024 --caches certified --out $W/cs_off_1k.json"
      step cs_4k 110 "CERTATTN_DECODE_BRIDGE=0 $S --prompts 4096 --caches certified --out $W/cs_off_4k.json; $S --prompts 4096 --caches certified --out $W/cs_on_4k.json"
      step cs_steady 50 "CERTATTN_DECODE_BRIDGE_STEADY=1 $S --prompts 1024 --caches certified --out $W/cs_steady_1k.json"
      step c8_steady_k 80 "CERTATTN_LOOPED_WEIGHTS=kernel CERTATTN_DECODE_BRIDGE_STEADY=1 $G8 --caches certified --out $W/c8_steady_kernel.json" ;;
    steady)  # twenty-eighth session: the bridge's first passes as the steady decode loop (CERTATTN_DECODE_BRIDGE_STEADY=1:
      # one host wait per common step, the whole program one call per rare step) against the plain loop, SmolLM2 1K
      # and 4K and 8B 8K, dense in the call; each pair in one step
      S="${B/--timeout 150/--timeout 70} --new-tokens 64 --models smollm2"
      step st_s1k 130 "$S --prompts 1024 --caches dense certified --out $W/st_plain_1k.json; CERTATTN_DECODE_BRIDGE_STEADY=1 $S --prompts 1024 --caches certified --out $W/st_steady_1k.json"
      step st_s4k 130 "CERTATTN_DECODE_BRIDGE_STEADY=1 $S --prompts 4096 --caches certified --out $W/st_steady_4k.json; $S --prompts 4096 --caches dense certified --out $W/st_plain_4k.json"
      # 8B: with its per-layer switches (a predicate each), then with the layers read stacked by the kernel (none)
      step st_8b 180 "CERTATTN_DECODE_BRIDGE_STEADY=1 $B --new-tokens 32 --models llama3.1-8b --prompts 8192 --caches certified --out $W/st_steady_8b.json; CERTATTN_LOOPED_WEIGHTS=kernel CERTATTN_DECODE_BRIDGE_STEADY=1 $B --new-tokens 32 --models llama3.1-8b --prompts 8192 --caches certified --out $W/st_steady_8b_kernel.json" ;;
    picks)  # twenty-seventh session: the fused check on one way of picking (its cache's): the 8B 8K certified row
      # checks only the looped cache, SmolLM2 4K only the counted one; check seconds, compile, verdicts (fused used)
      G8="CERTATTN_SELFTEST_CACHE=off $B --new-tokens 32 --models llama3.1-8b --prompts 8192"
      step picks_8_dense 60 "$G8 --caches dense --out $W/picks_8_dense.json"
      step picks_8_cert 80 "$G8 --caches certified --out $W/picks_8_cert.json"
      step picks_s4k 60 "CERTATTN_SELFTEST_CACHE=off ${B/--timeout 150/--timeout 50} --new-tokens 64 --models smollm2 --prompts 4096 --caches certified --out $W/picks_s4k.json" ;;
    ab_fats)  # the same A/B for SmolLM2 1K
      GS="CERTATTN_SELFTEST_CACHE=off ${B/--timeout 150/--timeout 90} --new-tokens 64 --models smollm2 --prompts 1024"
      step fat2_s_xla_1 70 "$GS --caches dense certified --out $W/fat2_s_xla_1.json"
      step fat2_s_off_1 60 "CERTATTN_FUSION_AUTOTUNER=0 $GS --caches certified --out $W/fat2_s_off_1.json"
      step fat2_s_xla_2 60 "$GS --caches certified --out $W/fat2_s_xla_2.json"
      step fat2_s_off_2 60 "CERTATTN_FUSION_AUTOTUNER=0 $GS --caches certified --out $W/fat2_s_off_2.json" ;;
    unroll_fp)  # twenty-ninth session: (1) the bridge's rung-0 first pass unrolled over layers
      # (CERTATTN_FIRST_PASS_UNROLLED=background: built beside the whole program, the warm runs run it; straight-line code, no while loop over layers, whose every iteration the
      # host drives: ~11 us each on the H200, probe_cmdbuf; at 8B no per-layer switch either) and (2) the certify
      # kernel's single-chunk form (the default now; CERTATTN_RUNG0_SINGLE_CHUNK=0 the general form), each against
      # the default, alternated, dense in the call
      S="${B/--timeout 150/--timeout 100} --new-tokens 64 --models smollm2"
      G8="CERTATTN_SELFTEST_CACHE=off ${B/--timeout 150/--timeout 150} --new-tokens 32 --models llama3.1-8b --prompts 8192"
      U="CERTATTN_FIRST_PASS_UNROLLED=background"
      C="CERTATTN_RUNG0_SINGLE_CHUNK=0"
      S4="$S --prompts 4096 --caches certified"
      step u4_def 90 "$S --prompts 4096 --caches dense certified --out $W/u_4k_def_a.json"
      step u4_bg 120 "$U $S4 --out $W/u_4k_bg_a.json"
      step u4_gen 60 "$C $S4 --out $W/u_4k_gen_a.json"
      step u8_bg 150 "$U $G8 --caches certified --out $W/u8_bg.json"
      step u8_def 150 "$G8 --caches dense certified --out $W/u8_def.json"
      step u4_def2 60 "$S4 --out $W/u_4k_def_b.json"
      step u1 110 "$S --prompts 1024 --caches dense certified --out $W/u_1k_def.json; $U $S --prompts 1024 --caches certified --out $W/u_1k_bg.json" ;;
    unroll_smol|unroll_8b|unroll_key|unroll_min|unroll_tiny)  # thirtieth session: unroll_fp split in two calls of < 600 s (SmolLM2 rows +
      # the compiled single-chunk kernel tests; then the 8B rows); unroll_key: the deciding rows alone, in one call
      # (SmolLM2 4K default / background-unrolled, 8B 8K background-unrolled / dense + default, then SmolLM2 1K)
      S="${B/--timeout 150/--timeout 100} --new-tokens 64 --models smollm2"
      G8="CERTATTN_SELFTEST_CACHE=off ${B/--timeout 150/--timeout 150} --new-tokens 32 --models llama3.1-8b --prompts 8192"
      U="CERTATTN_FIRST_PASS_UNROLLED=background"
      C="CERTATTN_RUNG0_SINGLE_CHUNK=0"
      S4="$S --prompts 4096 --caches certified"
      if [ "$s" = unroll_tiny ]; then  # the least that compares: SmolLM2 4K dense + unrolled, then the default
        step u4_bgd 120 "$U $S --prompts 4096 --caches dense certified --out $W/u_4k_bg_dense.json"
        step u4_def2 70 "$S4 --out $W/u_4k_def_b.json"
      elif [ "$s" = unroll_min ]; then  # with little device time left: SmolLM2 4K both ways, 8B 8K unrolled
        step u4_def 90 "$S --prompts 4096 --caches dense certified --out $W/u_4k_def_a.json"
        step u4_bg 120 "$U $S4 --out $W/u_4k_bg_a.json"
        step u8_bg 150 "$U $G8 --caches certified --out $W/u8_bg.json"
      elif [ "$s" = unroll_key ]; then
        step u4_def 90 "$S --prompts 4096 --caches dense certified --out $W/u_4k_def_a.json"
        step u4_bg 120 "$U $S4 --out $W/u_4k_bg_a.json"
        step u8_bg 150 "$U $G8 --caches certified --out $W/u8_bg.json"
        step u8_def 150 "$G8 --caches dense certified --out $W/u8_def.json"
        step u1 110 "$S --prompts 1024 --caches dense certified --out $W/u_1k_def.json; $U $S --prompts 1024 --caches certified --out $W/u_1k_bg.json"
      elif [ "$s" = unroll_smol ]; then
        step u4_def 90 "$S --prompts 4096 --caches dense certified --out $W/u_4k_def_a.json"
        step u4_bg 120 "$U $S4 --out $W/u_4k_bg_a.json"
        step u4_def2 60 "$S4 --out $W/u_4k_def_b.json"
        step u1 110 "$S --prompts 1024 --caches dense certified --out $W/u_1k_def.json; $U $S --prompts 1024 --caches certified --out $W/u_1k_bg.json"
        step u4_gen 60 "$C $S4 --out $W/u_4k_gen_a.json"
        step sc_tests 100 "python3 -m pytest -q -n 8 -p no:benchmark tests/test_certify_rung0.py -k 'matches_the_jnp or single_chunk or lowers'"
      else
        step u8_bg 150 "$U $G8 --caches certified --out $W/u8_bg.json"
        step u8_def 150 "$G8 --caches dense certified --out $W/u8_def.json"
      fi ;;
    att_grid)  # twenty-ninth session: issue 8's grid at the contexts with targets (32K, 128K), batch 1 and 8, every
      # dense baseline, naive and certified on both data kinds (the forced rungs: att_rungs, 2026-12-03)
      step att_grid 420 "python3 scripts/bench_attention.py --contexts 32768,131072 --batches 1,8 --impls torch_sdpa_bf16 jax_cudnn_bf16 jax_xla_bf16 pallas_dense_bf16 naive certified --out $W/att_grid.json" ;;
    dec128_cert)  # the 8B 128K certified decode row alone, with the offsets guard (its rung histogram against
      # 2026-12-04's 12,188 rung-3 / 5,824 rung-4 of 196,608 head-steps)
      step dec128_cert 240 "python3 scripts/bench_decode.py --models llama3.1-8b --contexts 131072 --batches 1 --caches certified --impls einsum --out $W/dec128_certified.json" ;;
    lower8b_prof)  # twenty-sixth session: where the 8B certified decode loop's 4 s of tracing + lowering go (dense:
      # 0.4 s): one row under cProfile (main thread: the trace and the Pallas -> Triton lowering; inflated by it)
      step lower8b_prof 200 "python3 -m cProfile -o $W/lower8b.pstats scripts/bench_generate.py --row llama3.1-8b certified 8192 --new-tokens 8 --tier1 pallas > $W/lower8b_row.txt && python3 -c \"import pstats; s = pstats.Stats('$W/lower8b.pstats'); s.sort_stats('cumulative').print_stats(120); s.sort_stats('tottime').print_stats(40)\" > $W/lower8b_top.txt" ;;
    big_offsets)  # twenty-sixth session: a compiled kernel reading rows of a 3 GiB uint8 array (32-bit offsets, which
      # should wrap past 2**31) and of a 5 GiB one (64-bit): what `backend.offsets_fit` guards the product against
      # one case per process: an illegal address (the 3 GiB case, twenty-sixth session) poisons the CUDA context
      step big_offsets 150 "for r in 5 3 2; do python3 scripts/probe_large_offsets.py --rows \$r --out $W/probe_large_offsets_\$r.json; done" ;;
    ab_unroll4k)  # the same at 4K, the best count of ab_unroll (U) against 1
      G="python3 scripts/bench_generate.py --timeout 80 --new-tokens 64 --models smollm2 --prompts 4096"
      step abu4_1_1 90 "$G --caches dense certified --out $W/abu4_1_1.json"
      step abu4_u_1 75 "CERTATTN_LAYER_UNROLL=\${U:-5} $G --caches certified --out $W/abu4_u_1.json"
      step abu4_1_2 65 "$G --caches certified --out $W/abu4_1_2.json"
      step abu4_u_2 75 "CERTATTN_LAYER_UNROLL=\${U:-5} $G --caches certified --out $W/abu4_u_2.json" ;;
    cb_unroll)  # twenty-fifth session: the certified layer loop into one graph? A helper's reading of XLA's
      # command_buffer_conversion_pass (2026-12-06d, docs/performance.md): a while whose body holds a dynamic-slice
      # fusion with loop-dependent offsets (our "async dynamic-slice" pairs) is refused as a WHILE command unless
      # loop unrolling is on and the trip count known; then the pass converts the body alone (one graph per
      # iteration: what the trace shows). SmolLM2 1K, dense and certified, default against the flags that should
      # unroll the loop into the graph, the HLO of the default dumped (which arrays the copies slice), and a trace
      F="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION,CONDITIONAL,WHILE --xla_gpu_command_buffer_unroll_loops=true"
      G="python3 scripts/bench_generate.py --timeout 80 --new-tokens 64 --models smollm2 --prompts 1024"
      step cbu_def 85 "$G --caches dense certified --dump-hlo $W/hlo/cbu_def --out $W/cbu_def.json"
      step cbu_on 90 "XLA_FLAGS='$F' $G --caches dense certified --out $W/cbu_on.json"
      step cbu_trace 110 "XLA_FLAGS='$F' python3 scripts/trace_decode.py --model smollm2 --prompt 1024 --caches certified --steps 16 --out $W/cbu_trace.json"
      hlo_analyses; tar czf "$OUT/results.tgz" -C /tmp gpu_session ;;
    trace_unroll)  # the graph launches per step with U layers per iteration (should fall to ceil(30 / U))
      step trace_unroll 120 "CERTATTN_LAYER_UNROLL=\${U:-5} python3 scripts/trace_decode.py --model smollm2 --prompt 1024 --caches certified --steps 16 --out $W/trace_unroll.json" ;;
    ab_select)  # twenty-fourth session: the certify kernel's counted candidate selection (CERTATTN_RUNG0_SELECT=count,
      # one pairwise pass instead of k_max dependent ones, where one chunk holds every column) against the loop,
      # SmolLM2 1K and 4K certified, alternated, dense in the call; run `kernels` first (it checks count == loop
      # compiled, bit for bit)
      G="python3 scripts/bench_generate.py --timeout 80 --new-tokens 64 --models smollm2"
      # (limits: a cold 1K dense + certified process took 55-68 s on 2026-12-06d, so 45-60 s limits cut rows off)
      step abs_1k_loop1 85 "$G --prompts 1024 --caches dense certified --out $W/abs_1k_loop_1.json"
      step abs_1k_count1 65 "CERTATTN_RUNG0_SELECT=count $G --prompts 1024 --caches certified --out $W/abs_1k_count_1.json"
      step abs_4k_loop1 90 "$G --prompts 4096 --caches dense certified --out $W/abs_4k_loop_1.json"
      step abs_4k_count1 65 "CERTATTN_RUNG0_SELECT=count $G --prompts 4096 --caches certified --out $W/abs_4k_count_1.json"
      step abs_4k_loop2 65 "$G --prompts 4096 --caches certified --out $W/abs_4k_loop_2.json"
      step abs_1k_count2 65 "CERTATTN_RUNG0_SELECT=count $G --prompts 1024 --caches certified --out $W/abs_1k_count_2.json" ;;
    sound_count)  # the compiled soundness suites with the counted selection
      step sound_count 350 "CERTATTN_RUNG0_SELECT=count CERTATTN_TIER1=pallas CERTATTN_RUNG0=fused python3 -m pytest -q -n 16 tests/test_soundness.py tests/test_soundness_extreme.py" ;;
    nested_hlo)  # why the nested loop is 5 % slower (twenty-third session): both programs' GPU HLO (command buffers,
      # launches by scope, copies), SmolLM2 1K certified
      G="python3 scripts/bench_generate.py --timeout 80 --new-tokens 16 --models smollm2 --prompts 1024"
      step nh_plain 60 "$G --caches certified --dump-hlo $W/hlo/plain --out $W/nh_plain.json"
      step nh_nested 60 "CERTATTN_DECODE_LOOP_NESTED=1 $G --caches certified --dump-hlo $W/hlo/nested --out $W/nh_nested.json"
      hlo_analyses; tar czf "$OUT/results.tgz" -C /tmp gpu_session ;;
    sound_conc)  # the compiled soundness suites with every program's command buffers CONCURRENT
      step sound_conc 350 "XLA_FLAGS=--xla_gpu_command_buffer_scheduling_mode=CONCURRENT CERTATTN_TIER1=pallas CERTATTN_RUNG0=fused python3 -m pytest -q -n 16 --durations=12 tests/test_soundness.py tests/test_soundness_extreme.py" ;;
    glue) step glue 150 "python3 scripts/probe_glue_launches.py --out $W/glue" ;;  # the launches left per layer-step
    hlo) hlo_analyses; tar czf "$OUT/results.tgz" -C /tmp gpu_session ;;
    *) echo "unknown step $s" | tee -a "$OUT/summary.log" ;;
  esac
done
