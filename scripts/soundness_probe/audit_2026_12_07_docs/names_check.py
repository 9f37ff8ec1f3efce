"""Check names the docs mention as public API: existence + signatures (README.md, docs/architecture.md, docs/evaluation.md)."""
import importlib
import inspect


def show(path):
    mod, _, attr = path.rpartition(".")
    obj = None
    try:
        # allow Class.method
        try:
            m = importlib.import_module(mod)
            obj = getattr(m, attr)
        except ModuleNotFoundError:
            mod2, _, cls = mod.rpartition(".")
            m = importlib.import_module(mod2)
            obj = getattr(getattr(m, cls), attr)
    except Exception as e:
        print(f"MISSING {path}: {type(e).__name__}: {e}")
        return None
    try:
        sig = str(inspect.signature(obj))
    except (TypeError, ValueError):
        sig = f"<{type(obj).__name__}> {obj!r}"[:200]
    print(f"ok {path}{sig}")
    return obj

names = """
models.load_pretrained
models.generate.generate
models.llama.forward
models.llama.init_cache
models.llama.forward_hidden
models.llama.with_stacked_layers
models.llama.params_for_decoding
models.llama.decode_first_pass
models.llama.BRIDGE_SCHEDULES
models.generate.decode_compiler_options
models.generate.GenerationOutput
models.generate.DecodeBridgeError
models.generate.NonFiniteLogitsError
models.generate.BridgedDecode._passes
models.generate.UPGRADE_POLL_STEPS
models.decode_loop.resume
models.decode_loop.NONFINITE_TOKEN
models.pretrained.fetch_wheel_file
models.pretrained.convert
models.LlamaConfig
certattn_jax.CertPolicy
certattn_jax.summarize
certattn_jax.certificate.summarize
certattn_jax.certificate.pack
certattn_jax.certificate.mark_stopped
certattn_jax.certificate.Certificate
certattn_jax.TieredKVCache
certattn_jax.TieredKVCache.from_dense
certattn_jax.TieredKVCache.write_token
certattn_jax.TieredKVCache.with_lengths
certattn_jax.TieredKVCache.flush
certattn_jax.TieredKVCache.append
certattn_jax.certified_attention
certattn_jax.naive_attention
certattn_jax.dense_attention
certattn_jax.memory_report
certattn_jax.model_cache.CACHE_MODES
certattn_jax.model_cache.cache_spec
certattn_jax.model_cache.resolve_schedule
certattn_jax.model_cache.adaptive_rung0_streak
certattn_jax.model_cache.CacheSpec.staging
certattn_jax.model_cache.CacheSpec.from_staging
certattn_jax.model_cache.TieredModelCache.from_layers
certattn_jax.model_cache.TieredModelCache.from_dense
certattn_jax.model_cache.TieredModelCache.layer_view
certattn_jax.model_cache.TieredModelCache.undo_step
certattn_jax.model_cache.TieredModelCache.with_tier2_on_host
certattn_jax.model_cache.TieredModelCache.with_lengths
certattn_jax.model_cache.TieredModelCache.last_certificate
certattn_jax.model_cache.TieredModelCache.slow_steps
certattn_jax.kv_cache.masked_attention
certattn_jax.kv_cache.commit_arrays
certattn_jax.dense_cache.DenseKVCache
certattn_jax.bounds.value_statistics
certattn_jax.attention.exact_keys_values
certattn_jax.kernel_checks.compile_while_checking
certattn_jax.evals.decode.ensure_host_callback_platform
certattn_jax.evals.decode.EvalCache
certattn_jax.evals.audit.AuditCollector
certattn_jax.evals.stats.paired_ppl_delta
certattn_jax.evals.data.prose
certattn_jax.evals.data.word_lists
certattn_jax.needle.FORMATS
certattn_jax.xla_options
certattn_jax.policy.CertPolicy.tier1_impl
pallas_kernels.selftest.optimistic_verdicts
pallas_kernels.selftest.gather_trusted
pallas_kernels.backend.offsets_fit
"""
for n in names.split():
    show(n)

import dataclasses

from certattn_jax import CertPolicy

print("CertPolicy fields:", [ (f.name, f.default) for f in dataclasses.fields(CertPolicy)])
from certattn_jax.model_cache import CACHE_MODES

print("CACHE_MODES =", CACHE_MODES)
from models.generate import GenerationOutput

print("GenerationOutput fields:", [f.name for f in dataclasses.fields(GenerationOutput)] if dataclasses.is_dataclass(GenerationOutput) else dir(GenerationOutput))
from certattn_jax.certificate import Certificate

print("Certificate fields:", [f.name for f in dataclasses.fields(Certificate)])
import models.llama as L

print("BRIDGE_SCHEDULES", L.BRIDGE_SCHEDULES)
from certattn_jax import model_cache as mc

print("SCHEDULES", getattr(mc, "SCHEDULES", None))
