"""Does XLA update a stacked per-layer cache [L, B, H, S, d] in place inside a loop over layers? (docs/performance.md)

    PYTHONPATH=. python scripts/probe_stacked_cache.py

Three ways to write one decode step's token into layer i of a stacked cache and attend over that layer, jitted
with the cache donated; for each it counts, in the compiled HLO, copies of the whole stacked cache, layer-sized
dynamic-slice / fusion results (a layer slice materialized), and prints XLA's temp bytes (one layer slice here is
B*H*S*d*4 = 2.1 MB).
"""
import re

import jax
import jax.numpy as jnp

L, B, H, S, d = 4, 1, 2, 4096, 64
def layer_body(i, carry, q):
    k_all, v_all, x, pos = carry
    k_new = jnp.tanh(x[:, None, :d] + i)  # [B, 1, d] stand-in for the projection
    k_l = jax.lax.dynamic_index_in_dim(k_all, i, 0, keepdims=False)  # [B, H, S, d]
    k_l = jax.lax.dynamic_update_slice(k_l, jnp.broadcast_to(k_new[:, None], (B, H, 1, d)), (0, 0, pos, 0))
    k_all = jax.lax.dynamic_update_index_in_dim(k_all, k_l, i, 0)
    v_l = jax.lax.dynamic_index_in_dim(v_all, i, 0, keepdims=False)
    s = jnp.einsum("bd,bhsd->bhs", x[:, :d], k_l)
    out = jnp.einsum("bhs,bhsd->bd", jax.nn.softmax(s, -1), v_l)
    return (k_all, v_all, x + jnp.pad(out, ((0, 0), (0, x.shape[1] - d))), pos)

def variant_fori(k_all, v_all, x, pos):
    return jax.lax.fori_loop(0, L, lambda i, c: layer_body(i, c, None), (k_all, v_all, x, pos))

def variant_fori_direct(k_all, v_all, x, pos):
    """write only the new token into the stacked array (never DS + DUS of a whole layer slice)"""
    def body(i, c):
        k_all, v_all, x, pos = c
        k_new = jnp.tanh(x[:, None, :d] + i)
        k_all = jax.lax.dynamic_update_slice(k_all, jnp.broadcast_to(k_new[None, :, None], (1, B, H, 1, d)),
                                             (i, 0, 0, pos, 0))
        k_l = jax.lax.dynamic_index_in_dim(k_all, i, 0, keepdims=False)
        v_l = jax.lax.dynamic_index_in_dim(v_all, i, 0, keepdims=False)
        s = jnp.einsum("bd,bhsd->bhs", x[:, :d], k_l)
        out = jnp.einsum("bhs,bhsd->bd", jax.nn.softmax(s, -1), v_l)
        return (k_all, v_all, x + jnp.pad(out, ((0, 0), (0, x.shape[1] - d))), pos)
    return jax.lax.fori_loop(0, L, body, (k_all, v_all, x, pos))


def variant_scan_xs(k_all, v_all, x, pos):
    # the cache as scan xs/ys: each layer's slice comes in, the updated slice goes out (stacked anew)
    def body(c, kv):
        x, = c
        k_l, v_l = kv
        k_new = jnp.tanh(x[:, None, :d])
        k_l = jax.lax.dynamic_update_slice(k_l, jnp.broadcast_to(k_new[:, None], (B, H, 1, d)), (0, 0, pos, 0))
        s = jnp.einsum("bd,bhsd->bhs", x[:, :d], k_l)
        out = jnp.einsum("bhs,bhsd->bd", jax.nn.softmax(s, -1), v_l)
        return (x + jnp.pad(out, ((0, 0), (0, x.shape[1] - d))),), (k_l, v_l)
    (x,), (k_all, v_all) = jax.lax.scan(body, (x,), (k_all, v_all))
    return k_all, v_all, x, pos

k = jnp.zeros((L, B, H, S, d))
v = jnp.ones((L, B, H, S, d))
x = jnp.ones((B, 128))
pos = jnp.int32(5)
big = f"f32[{L},{B},{H},{S},{d}]"
one = f"f32[{B},{H},{S},{d}]"
variants = (("fori_loop + dynamic_update_index", variant_fori), ("fori_loop, token-only write", variant_fori_direct),
            ("scan xs/ys", variant_scan_xs))
for name, fn in variants:
    c = jax.jit(fn, donate_argnums=(0, 1)).lower(k, v, x, pos).compile()
    lines = c.as_text().splitlines()
    copies_big = sum(1 for line in lines if re.search("= " + re.escape(big) + r"\S* copy\(", line))
    copies_one = sum(1 for line in lines if re.search("= " + re.escape(one) + r"\S* copy\(", line))
    sliced = sum(1 for line in lines if re.search("= " + re.escape(one) + r"\S* (dynamic-slice|fusion)\(", line))
    print(f"{name}: layer-sized dynamic-slice/fusion results {sliced}; copies of the whole stacked cache "
          f"{copies_big}, of one layer's slice {copies_one}; temp bytes {c.memory_analysis().temp_size_in_bytes}")
