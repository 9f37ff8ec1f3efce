"""staging_batch (groups) with the fused switch on; trace / compile counts of repeated prefills; progress bar."""
from common import POLICY, diff, gen, np, prefilled, prompts

from models.decode_loop import TRACE_COUNTS

ps = prompts(5, [53, 21, 40, 7])
a, la = prefilled(True, "certified", ps, 96, 16, staging_batch=2)
b, lb = prefilled(False, "certified", ps, 96, 16, staging_batch=None)
d = diff(a, b)
print("staged (2 at a time, fused switch on) vs whole-batch eager:", "same" if not d else d[:4],
      "logits same:", np.array_equal(la, lb))
c, lc = prefilled(True, "certified", ps, 96, 16, staging_batch=None)
print("whole-batch fused vs whole-batch eager:", "same" if not diff(c, b) else diff(c, b)[:4])

fn = gen._prefill_last_chunk_converted
for label, lens, cap, chunk in [("A", [53, 21], 96, 16), ("A again", [50, 30], 96, 16), ("A again", [60, 3], 96, 16),
                                ("B (1 chunk)", [5, 3], 96, 16), ("B again", [6, 2], 96, 16),
                                ("A', other eps", [53, 21], 96, 16)]:
    t0, c0 = TRACE_COUNTS["prefill_chunk_converted"], fn._cache_size()
    pol = POLICY.replace(eps=0.2) if "eps" in label else POLICY
    prefilled(True, "certified", prompts(9, lens), cap, chunk, policy=pol)
    print(f"{label} lens={lens}: traces +{TRACE_COUNTS['prefill_chunk_converted'] - t0}, programs "
          f"+{fn._cache_size() - c0}", flush=True)
prefilled(True, "certified", prompts(9, [53, 21, 40]), 96, 16, progress=True)
print("progress=True: ok")
