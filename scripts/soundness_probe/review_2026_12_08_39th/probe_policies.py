"""Fused vs eager prefill under policy variants (hot slots, bits, tolerances as arrays / ints / NumPy, a cache's
own policy, with_policy), and compile counts of the fused program across calls."""

from common import POLICY, CertPolicy, diff, gen, jnp, np, prefilled, prompts

ps = prompts(1, [53, 21, 40])
base, _ = prefilled(False, "certified", ps, 96, 16)
variants = {
    "hot_slots8": CertPolicy(block_size=16, group_size=16, k_max=4, v_max=2, hot_slots=8),
    "bits4_2": CertPolicy(block_size=16, group_size=16, k_max=4, v_max=2, key_bits=4, value_bits=2),
    "int_abs_tol": POLICY.replace(abs_tol=0, eps=1),
    "np_float64_eps": POLICY.replace(eps=np.float64(0.02)),
    "strong_f32_eps": POLICY.replace(eps=jnp.float32(0.02)),
    "cache_policy": base.policy,
    "cache_policy_eps_replaced": base.policy.replace(eps=0.3),
    "with_policy": base.with_policy(POLICY.replace(eps=0.07)).policy,
    "bf16_eps": POLICY.replace(eps=jnp.bfloat16(0.02)),
    "int64_np_tol": POLICY.replace(rank_margin=np.int64(1)),
}
for name, pol in variants.items():
    for dtype in (jnp.float32, jnp.bfloat16):
        before = gen._prefill_last_chunk_converted._cache_size()
        a, la = prefilled(True, "certified", ps, 96, 16, policy=pol, dtype=dtype)
        mid = gen._prefill_last_chunk_converted._cache_size()
        a2, _ = prefilled(True, "certified", prompts(2, [53, 21, 40]), 96, 16, policy=pol, dtype=dtype)
        after = gen._prefill_last_chunk_converted._cache_size()
        b, lb = prefilled(False, "certified", ps, 96, 16, policy=pol, dtype=dtype)
        d = diff(a, b)
        same = np.asarray(la).tobytes() == np.asarray(lb).tobytes()
        print(f"{'OK' if not d and same else 'DIFF'} {name} {jnp.dtype(dtype).name}: new programs first={mid - before} "
              f"second={after - mid} logits_same={same} {d[:5]}", flush=True)
