# ruff: noqa  (the README snippet is kept verbatim, as a user would paste it)
"""README.md:68-85 "Your own decode loop". The snippet leaves `params`, `config` and `prompt` undefined; they are
filled in here from the README's first snippet (SmolLM2-135M-Instruct, float32, a chat prompt as a jnp int32 array).
The snippet itself follows verbatim between the markers, then checks of the README's claims around it."""
import jax.numpy as jnp
from models import load_pretrained
m = load_pretrained("smollm2", dtype=jnp.float32)
params, config = m.params, m.config
prompt = jnp.asarray(m.tokenizer.encode(m.tokenizer.apply_chat_template(
    [{"role": "user", "content": "Name three colours."}])), jnp.int32)
# --- snippet verbatim ---
import jax, jax.numpy as jnp
from certattn_jax import CertPolicy
from certattn_jax.model_cache import cache_spec
from models import llama

spec = cache_spec("certified", config, params["embed"].dtype, CertPolicy())
fwd = jax.jit(llama.forward, static_argnums=1, donate_argnums=3)   # (params, config, tokens, cache)

cache = spec.staging(batch=1, capacity=4096)          # prefill into a dense cache (exact, device-resident) ...
logits, cache = fwd(params, config, prompt[None, :], cache)  # (chunk a long prompt: several calls of one chunk shape)
cache = spec.from_staging(cache)                      # ... then convert once: tier 1 + tier 2 in pinned_host
tok = jnp.argmax(logits[:, -1], -1)
for _ in range(100):                                  # compiled on the first step only
    logits, cache = fwd(params, config, tok[:, None], cache)  # the old `cache` is donated: never touch it again
    tok = jnp.argmax(logits[:, -1], -1)
certificates = cache.last_certificate                 # this step's, leaves [layers, batch, heads]
# --- end of snippet ---
print("compiled programs of fwd:", fwd._cache_size(), "(expect 2: prefill into staging + decode on the tiered cache)")
print("type:", type(cache).__name__, "tier-2 memory kind:", cache.layers[0].host_k.sharding.memory_kind
      if hasattr(cache, "layers") else "?")
print("last_certificate error_bound shape", certificates.error_bound.shape, "(README: leaves [layers, batch, heads])",
      "rung hist", jnp.bincount(certificates.rung.reshape(-1).astype(jnp.int32), length=5))
print("slow_steps", cache.slow_steps, "lengths", cache.lengths)
