# ruff: noqa  (the README snippet is kept verbatim, as a user would paste it)
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
