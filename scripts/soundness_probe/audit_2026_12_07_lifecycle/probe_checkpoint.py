"""Case 3: params checkpoints (models/checkpoint.py) mid-generation, and what a damaged or mismatched checkpoint
gives. The library has no cache checkpoint API; a generic orbax save of a cache pytree is tried for reference."""
import json
import shutil
import tempfile
from pathlib import Path

from common import *  # noqa: F403

from models import checkpoint as ck
from models.params import cast_params

tmp = Path(tempfile.mkdtemp(prefix="certattn_ckpt_audit_"))
params = params_for()
spec = cache_spec("certified", CFG, jnp.float32, POLICY)
P = prompts((23, 45))
N, M = 8, 6
C = 45 + N + M + 3
fwd = jax.jit(llama.forward, static_argnums=1, donate_argnums=3)

full = gen.generate(params, CFG, P, N + M, cache_factory=spec, capacity=C, progress=False)
first = gen.generate(params, CFG, P, N, cache_factory=spec, capacity=C, progress=False)
path = ck.save_checkpoint(tmp / "f32", params, CFG)
cfg2, p2, _ = ck.load_checkpoint(path)
print("restored config == config:", cfg2 == CFG, "| dtypes", sorted({str(x.dtype) for x in jax.tree.leaves(p2)}))
p2 = jax.tree.map(jnp.asarray, p2)
cache = first.cache
tok = jnp.asarray([t[-1] for t in first.tokens], jnp.int32)
toks = [list(t) for t in first.tokens]
for _ in range(M):
    lg, cache = fwd(p2, cfg2, tok[:, None], cache)
    tok = jnp.argmax(lg[:, -1], -1).astype(jnp.int32)
    for i, t in enumerate(np.asarray(tok)):
        toks[i].append(int(t))
print("save params mid-generation, restore, continue the cache with restored params == one call:", toks == full.tokens)

# bf16 params round trip
pb = cast_params(params, jnp.bfloat16)
attempt("save+load bf16 params (dtype kept?)", lambda: sorted({str(x.dtype) for x in jax.tree.leaves(
    ck.load_checkpoint(ck.save_checkpoint(tmp / "bf16", pb, CFG))[1])}))
attempt("save params with a stacked copy (llama.with_stacked_layers)",
        lambda: ck.save_checkpoint(tmp / "stacked", llama.with_stacked_layers(params), CFG))
if (tmp / "stacked").exists():
    attempt("load it back", lambda: sorted(ck.load_checkpoint(tmp / "stacked")[1]))
attempt("save fused params (llama.fuse_projections)",
        lambda: ck.save_checkpoint(tmp / "fused", llama.fuse_projections(params), CFG))
if (tmp / "fused").exists():
    attempt("load it back", lambda: sorted(ck.load_checkpoint(tmp / "fused")[1]["layers"][0]))


def damaged(name, damage):
    d = tmp / name
    shutil.copytree(path, d)
    damage(d)
    attempt(f"load {name}", lambda: ("loaded; config", ck.load_checkpoint(d)[0]))


def data_files(d):
    return sorted(p for p in (d / "params").rglob("*") if p.is_file() and p.stat().st_size > 0)


print("params files:", [str(p.relative_to(path)) for p in data_files(path)][:12])
biggest = lambda d: max(data_files(d), key=lambda p: p.stat().st_size)  # noqa: E731


def truncate(d):
    f = biggest(d)
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def flip(d):
    f = biggest(d)
    b = bytearray(f.read_bytes())
    b[len(b) // 2] ^= 0x40
    f.write_bytes(bytes(b))


def remove_one(d):
    biggest(d).unlink()


def config_edit(**kw):
    def edit(d):
        j = json.loads((d / "config.json").read_text())
        j.update(kw)
        (d / "config.json").write_text(json.dumps(j))
    return edit


def marker_edit(fn):
    def edit(d):
        j = json.loads((d / ck.MARKER_FILE).read_text())
        fn(j)
        (d / ck.MARKER_FILE).write_text(json.dumps(j))
    return edit


damaged("truncated_data_file", truncate)
damaged("flipped_byte", flip)
damaged("missing_data_file", remove_one)
damaged("params_dir_removed", lambda d: shutil.rmtree(d / "params"))
damaged("config_num_layers_1", config_edit(num_hidden_layers=1))
damaged("config_num_layers_3", config_edit(num_hidden_layers=3))
damaged("config_hidden_128", config_edit(hidden_size=128))
damaged("config_vocab_95", config_edit(vocab_size=95))
damaged("config_rope_theta_changed", config_edit(rope_theta=500000.0))
damaged("config_truncated", lambda d: (d / "config.json").write_text((d / "config.json").read_text()[:40]))
damaged("marker_without_checksums", marker_edit(lambda j: j.pop("checksums")))
damaged("marker_version_2", marker_edit(lambda j: j.update(version=2)))

print("== a cache through orbax (no library API; generic pytree save) ==")
import orbax.checkpoint as ocp  # noqa: E402


def cache_round_trip(c, name):
    ocp.PyTreeCheckpointer().save(tmp / name, c)
    r = ocp.PyTreeCheckpointer().restore(tmp / name, item=c)
    kinds = lambda t: sorted({str(getattr(getattr(x, "sharding", None), "memory_kind", None))  # noqa: E731
                              for x in jax.tree.leaves(t)})
    tok = jnp.asarray([t[-1] for t in first2.tokens], jnp.int32)
    a = np.asarray(fwd(params, CFG, tok[:, None], r)[0])
    b = np.asarray(fwd(params, CFG, tok[:, None], c)[0])
    return (type(r).__name__, "memory kinds saved", kinds(c), "restored", kinds(r),
            "next-step logits equal", bool(np.array_equal(a, b)))

first2 = gen.generate(params, CFG, P, N, cache_factory=spec, capacity=C, progress=False)
from certattn_jax import tiers  # noqa: E402

print("tier-2 memory kind on this backend:", tiers.host_memory_kind(),
      "| host_k kind", first2.cache.store.host_k.sharding.memory_kind)
attempt("orbax save/restore a certified TieredModelCache", lambda: cache_round_trip(first2.cache, "cache_cert"))
shutil.rmtree(tmp)
