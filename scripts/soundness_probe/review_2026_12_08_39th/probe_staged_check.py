"""Is the staged-vs-whole difference pre-existing? staged with the switch off vs on; staged vs whole at 86c8454's
behaviour is not runnable here, so compare the staged path with itself and with the whole batch under both switches."""
from common import diff, np, prefilled, prompts

ps = prompts(5, [53, 21, 40, 7])
on, lon = prefilled(True, "certified", ps, 96, 16, staging_batch=2)
off, loff = prefilled(False, "certified", ps, 96, 16, staging_batch=2)
print("staged: switch on vs off:", "same" if not diff(on, off) else diff(on, off)[:4], np.array_equal(lon, loff))
w, lw = prefilled(False, "certified", ps, 96, 16, staging_batch=None)
print("staged(off) vs whole(off): logits max abs diff", float(np.abs(np.asarray(loff) - np.asarray(lw)).max()))
