"""README.md "Your own decode loop" rules and "Bad input is a clear error" (README.md:87-131), each claim checked on
the tiny model the tests use (tests/test_e2e_cache.py: CFG, POLICY, llama.init_params(scale=0.3)) -- the claims
are about shapes and errors, not about the 135M model."""
import dataclasses
import math
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from certattn_jax import CertPolicy, TieredKVCache, TieredModelCache
from certattn_jax.model_cache import cache_spec
from models import llama
from models.config import LlamaConfig
from models.generate import generate

CFG = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=32, max_position_embeddings=2048)
POLICY = CertPolicy(block_size=16, group_size=16, k_max=4, v_max=2)
params = llama.init_params(CFG, jax.random.key(0), jnp.float32, scale=0.3)
results = []


def claim(name, fn, expect_error=None):
    try:
        r = fn()
        if expect_error:
            results.append((name, f"FAIL: no error raised (returned {type(r).__name__})"))
        else:
            results.append((name, f"ok: {r}"))
    except Exception as e:  # noqa: BLE001
        msg = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        if expect_error and any(s.lower() in str(e).lower() for s in expect_error):
            results.append((name, f"ok (refused): {msg}"))
        elif expect_error:
            results.append((name, f"error raised but message does not name {expect_error}: {msg}"))
        else:
            results.append((name, f"FAIL: {msg}\n{traceback.format_exc()[-800:]}"))


P = lambda: generate(params, CFG, [[1, 2, 3]], 2, progress=False)  # noqa: E731
claim("generate([[1,2,3]], 2) works", lambda: P().tokens)
claim("flat prompt list refused", lambda: generate(params, CFG, [1, 2, 3], 2, progress=False), ["list"])
claim("float ids refused", lambda: generate(params, CFG, [[1.0, 2.5]], 2, progress=False), ["int"])
claim("NaN temperature refused", lambda: generate(params, CFG, [[1, 2]], 2, temperature=float("nan"), progress=False),
      ["temperature"])
claim("non-integer max_new_tokens refused", lambda: generate(params, CFG, [[1, 2]], 2.5, progress=False), ["max_new_tokens"])
bad = {**params, "embed": params["embed"].at[0, 0].set(jnp.nan)}
claim("NaN params named", lambda: generate(bad, CFG, [[1, 2]], 2, progress=False), ["embed"])
claim("CertPolicy(eps=nan) refused", lambda: CertPolicy(eps=float("nan")), ["eps"])
claim("CertPolicy(tau_cov=inf) refused", lambda: CertPolicy(tau_cov=math.inf), ["tau_cov"])
claim("LlamaConfig(rope_theta=0) refused", lambda: dataclasses.replace(CFG, rope_theta=0.0), ["rope_theta"])

spec = cache_spec("certified", CFG, jnp.float32, POLICY)
fwd = jax.jit(llama.forward, static_argnums=1, donate_argnums=3)
prompt = jnp.arange(1, 40, dtype=jnp.int32)


def fresh(policy=POLICY):
    s = cache_spec("certified", CFG, jnp.float32, policy)
    c = s.staging(batch=1, capacity=128)
    logits, c = fwd(params, CFG, prompt[None, :], c)
    return s.from_staging(c), jnp.argmax(logits[:, -1], -1)


def tolerances_do_not_recompile():
    c, tok = fresh()
    logits, c = fwd(params, CFG, tok[:, None], c)
    n1 = fwd._cache_size()
    c2, tok2 = fresh(dataclasses.replace(POLICY, eps=0.01, tau_cov=0.9))
    logits, c2 = fwd(params, CFG, tok2[:, None], c2)
    n2 = fwd._cache_size()
    c3, tok3 = fresh(dataclasses.replace(POLICY, k_max=2))
    logits, c3 = fwd(params, CFG, tok3[:, None], c3)
    n3 = fwd._cache_size()
    assert n1 == n2, (n1, n2)
    return f"programs after eps/tau_cov change: {n1} -> {n2}; after k_max change (layout: recompiles): {n3}"


claim("new eps/tau_cov do not recompile; k_max does", tolerances_do_not_recompile)


def shrink():
    c, _ = fresh()
    return c.with_lengths(c.lengths - 1)


claim("with_lengths refuses to shrink a tiered cache", shrink, ["shrink", "grow", "length"])


def wrong_batch():
    c, tok = fresh()
    return fwd(params, CFG, jnp.concatenate([tok, tok])[:, None], c)


claim("tokens of another batch than the cache named", wrong_batch, ["batch"])


def other_shape():
    cfg2 = dataclasses.replace(CFG, num_layers=3)
    s2 = cache_spec("certified", cfg2, jnp.float32, POLICY)
    c = s2.staging(batch=1, capacity=128)
    return llama.forward(params, CFG, prompt[None, :], c)


claim("cache of another model shape refused by name", other_shape, ["layer", "shape"])


def device_get_then_fix():
    c, tok = fresh()
    c_host = jax.device_put(jax.device_get(c))
    kind = c_host.layers[0].host_k.sharding.memory_kind if hasattr(c_host, "layers") else "?"
    try:
        fwd(params, CFG, tok[:, None], c_host)
        named = "NOT named (forward ran)"
    except Exception as e:  # noqa: BLE001
        named = f"named: {type(e).__name__}: {str(e)[:160]}"
    fixed = c_host.with_tier2_on_host()
    logits, fixed = fwd(params, CFG, tok[:, None], fixed)
    return f"after device_get/device_put tier-2 kind={kind}; forward: {named}; with_tier2_on_host() then forward ok"


claim("device_get'd cache named, with_tier2_on_host fixes", device_get_then_fix)


def full_residual():
    k = jnp.ones((1, 16, 2, 32), jnp.float32)
    c = TieredKVCache.from_dense(k, k, POLICY, capacity=64)  # 16 tokens = one full block, flushed
    c = c.write_token(jnp.ones((1, 1, 2, 32)), jnp.ones((1, 1, 2, 32)))
    for _ in range(16):
        c = c.write_token(jnp.ones((1, 1, 2, 32)), jnp.ones((1, 1, 2, 32)))
    return "wrote 17 tokens without flush: no error"


claim("write_token into a full residual block asks for flush()", full_residual, ["flush"])


def from_layers_rule():
    k = jax.random.normal(jax.random.key(3), (1, 40, 2, 32))
    layers = [TieredKVCache.from_dense(k, k, POLICY, capacity=128)] * 2  # shared buffers allowed
    c = TieredModelCache.from_layers(layers, num_q_heads=4, policy=POLICY)
    n0 = fwd._cache_size()
    logits, c = fwd(params, CFG, jnp.array([[5]]), c)
    logits, c = fwd(params, CFG, jnp.array([[6]]), c)
    return f"from_layers cache decodes; new programs: {fwd._cache_size() - n0} (expect <=1: reused across calls)"


claim("TieredKVCache.from_dense + TieredModelCache.from_layers into the jit loop", from_layers_rule)


def generate_out_cache_decodable():
    out = generate(params, CFG, [[1, 2, 3], [4, 5, 6, 7]], 3, cache_factory="certified", policy=POLICY,
                   record_steps=True, progress=False)
    c = out.cache
    tok = jnp.array([[out.tokens[0][-1]], [out.tokens[1][-1]]])
    logits, c = fwd(params, CFG, tok, c)
    return f"out.cache ({type(c).__name__}) decoded one more step, lengths {np.asarray(c.lengths)}"


claim("generate's out.cache can be decoded on", generate_out_cache_decodable)

for n, r in results:
    print(f"[{n}] {r}")
