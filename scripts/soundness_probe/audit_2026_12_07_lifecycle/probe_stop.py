"""Case 5: one sequence of a batch stops early (EOS); the others continue. Tokens, finished, records and the
returned cache of the finished sequence; what `summarize` pools; continuing the finished sequence's cache."""
from common import *  # noqa: F403

from certattn_jax import summarize

params = params_for()
spec = cache_spec("certified", CFG, jnp.float32, POLICY)
P = prompts((23, 45))
MAXN = 16
base = gen.generate(params, CFG, P, MAXN, cache_factory=spec, progress=False, record_steps=True)
print("no-EOS tokens:", base.tokens)
# an EOS: seq 0's token at index 3 that does not occur in seq 1 nor earlier in seq 0
cands = [t for i, t in enumerate(base.tokens[0]) if i >= 2 and t not in base.tokens[1] and t not in base.tokens[0][:i]]
eos = cands[0]
stop_at = base.tokens[0].index(eos)
print(f"eos id {eos}: seq 0 emits it as generated token {stop_at}")
out = gen.generate(params, CFG, P, MAXN, cache_factory=spec, progress=False, record_steps=True, eos_token_ids=[eos])
print("with EOS tokens:", out.tokens, "finished", out.finished, "num_steps", out.num_steps)
print("seq 0 == prefix before EOS:", out.tokens[0] == base.tokens[0][:stop_at])
print("seq 1 unchanged by seq 0's stop:", out.tokens[1] == base.tokens[1])
rec = out.step_records
eb, rung, cert = np.asarray(rec.error_bound), np.asarray(rec.rung), np.asarray(rec.certified)
print("records shape [steps-1, L, B, Hq]:", eb.shape)
# record i is the step that produced generated token i+1; seq 0's EOS is token stop_at, produced by record stop_at-1;
# records >= stop_at are steps over the post-EOS (garbage) tokens of seq 0
post = slice(stop_at, None)
print(f"seq 0 records after its stop (steps {stop_at}..{eb.shape[0]-1}): finite bounds "
      f"{bool(np.isfinite(eb[post, :, 0]).all())}, certified fraction {cert[post, :, 0].mean():.3f}, "
      f"rungs {np.bincount(rung[post, :, 0].ravel(), minlength=5).tolist()}  (no mask field marks them)")
print("records carry any per-sequence validity mask?", [f for f in rec.__dataclass_fields__])
s_all = summarize(rec)
live = jax.tree.map(lambda x: np.asarray(x)[:, :, 1:], rec)
pre = jax.tree.map(lambda x: np.asarray(x)[:stop_at, :, :1], rec)
print("summarize(out.step_records) heads:", s_all["heads"], "vs live head-steps:",
      summarize(live)["heads"] + summarize(pre)["heads"])
lens = np.asarray(out.cache.lengths).tolist()
print(f"returned cache lengths {lens}; seq 0's real tokens prompt+generated+EOS = {len(P[0]) + len(out.tokens[0]) + 1}"
      f", seq 1 prompt + generated - 1 = {len(P[1]) + len(out.tokens[1]) - 1}")

# continue the batch from out.cache with the README loop: what does seq 0 continue from?
fwd = jax.jit(llama.forward, static_argnums=1, donate_argnums=3)
cache = out.cache
tok = jnp.asarray([eos, out.tokens[1][-1]], jnp.int32)
lg, cache = fwd(params, CFG, tok[:, None], cache)
# reference: seq 0 alone with prompt + generated + EOS, fed as one prefill (what a user would expect to continue from)
ref_cache, ref_logits = gen.prefill(params, CFG, [P[0] + out.tokens[0] + [eos]], 64, cache_factory="dense")
print("continuing seq 0 from out.cache vs its true context (prompt+tokens+EOS): max|logit diff| "
      f"{float(np.max(np.abs(np.asarray(lg[0, -1]) - np.asarray(ref_logits[0])))):.3f}")

# all sequences stop: records trimmed to num_steps - 1?
eos_all = [eos, base.tokens[1][4]]
out2 = gen.generate(params, CFG, P, MAXN, cache_factory=spec, progress=False, record_steps=True, eos_token_ids=eos_all)
print("both stop:", out2.tokens, out2.finished, "num_steps", out2.num_steps, "records",
      np.shape(out2.step_records.error_bound))
