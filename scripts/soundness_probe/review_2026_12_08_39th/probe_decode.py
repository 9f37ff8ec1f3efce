"""generate(record_steps=True) after the fused and the eager prefill: tokens, certificates, decode traces."""
from common import CFG, POLICY, CertPolicy, gen, jax, jnp, np, params, prompts

from models.decode_loop import TRACE_COUNTS

cases = [("certified", jnp.float32, [40, 33], 16, POLICY),
         ("naive", jnp.float32, [53, 1, 17], 16, POLICY),
         ("certified", jnp.bfloat16, [53, 1, 17], 16, POLICY.replace(eps=0.01)),
         ("certified", jnp.bfloat16, [32], 32, CertPolicy(block_size=16, group_size=16, k_max=4, v_max=2,
                                                          hot_slots=8, eps=0.001)),
         ("certified", jnp.float32, [1], 8, POLICY)]
for mode, dtype, lens, chunk, pol in cases:
    ps = prompts(7, lens)
    outs, traces = [], []
    for fused in (True, False, True):
        gen.PREFILL_CONVERSION_IN_CHUNK = fused
        before = TRACE_COUNTS["decode_loop"]
        outs.append(gen.generate(params(dtype), CFG, ps, 12, cache_factory=mode, policy=pol, prefill_chunk=chunk,
                                 progress=False, record_steps=True, eos_token_ids=()))
        traces.append(TRACE_COUNTS["decode_loop"] - before)
    same_tok = outs[0].tokens == outs[1].tokens
    recs = all(np.array_equal(np.asarray(x), np.asarray(y), equal_nan=True)
               for x, y in zip(jax.tree.leaves(outs[0].step_records), jax.tree.leaves(outs[1].step_records),
                               strict=False))
    cert = outs[0].step_records
    ncert = None
    if hasattr(cert, "certified"):
        ncert = int(np.asarray(cert.certified).sum())
    print(f"{'OK' if same_tok and recs else 'DIFF'} {mode} {jnp.dtype(dtype).name} lens={lens} chunk={chunk}: "
          f"tokens_same={same_tok} records_same={recs} decode_traces(fused,eager,fused)={traces} certified={ncert}",
          flush=True)
