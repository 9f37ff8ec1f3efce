"""Every backticked dotted name in README.md and docs/*.md (not performance.md), e.g. `llama.forward`,
`certificate.summarize`, `CacheSpec.from_staging`, `selftest.gather_trusted`, resolved against the code: tried
as written and under the packages certattn_jax, certattn_jax.evals, models, pallas_kernels, and as an attribute
of a public class. Unresolved names are printed for manual review (file paths, results files and XLA names are
filtered out)."""
import importlib
import inspect
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
DOCS = ["README.md"] + sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md") if p.name != "performance.md")
PKGS = ["", "certattn_jax.", "certattn_jax.evals.", "models.", "pallas_kernels."]
import certattn_jax  # noqa: E401,F401
from certattn_jax import cache, certificate, model_cache, policy  # noqa: F401

CLASSES = {"TieredKVCache": "certattn_jax.cache", "TieredModelCache": "certattn_jax.model_cache",
           "CacheSpec": "certattn_jax.model_cache", "CertPolicy": "certattn_jax.policy",
           "GenerationOutput": "models.generate", "BridgedDecode": "models.generate",
           "DenseKVCache": "certattn_jax.dense_cache", "Certificate": "certattn_jax.certificate",
           "EvalCache": "certattn_jax.evals.decode", "AuditCollector": "certattn_jax.evals.audit",
           "LlamaConfig": "models.config", "Pretrained": "models.pretrained"}


def resolve(name):
    parts = name.split(".")
    for pre in PKGS:
        full = (pre + name).split(".")
        for cut in range(len(full), 0, -1):
            try:
                obj = importlib.import_module(".".join(full[:cut]))
            except Exception:
                continue
            try:
                for a in full[cut:]:
                    obj = getattr(obj, a)
                return pre + name
            except AttributeError:
                break
    if parts[0] in CLASSES:
        obj = getattr(importlib.import_module(CLASSES[parts[0]]), parts[0])
        try:
            for a in parts[1:]:
                if dataclasses_field(obj, a):
                    obj = None
                    continue
                obj = getattr(obj, a)
            return CLASSES[parts[0]] + "." + name
        except AttributeError:
            return None
    return None


def dataclasses_field(cls, a):
    import dataclasses
    return inspect.isclass(cls) and dataclasses.is_dataclass(cls) and a in {f.name for f in dataclasses.fields(cls)}


SKIP = re.compile(r"(\.(py|md|json|jsonl|png|txt|sh|gguf|yaml|log|toml)$)|^(results|docs|tests|scripts|jax|jnp|lax|np|xla|out|cache|args|cert|m|spec|self|policy\.eps|q|k|v)\b")
seen = {}
for doc in DOCS:
    text = (ROOT / doc).read_text()
    for m in re.finditer(r"`([^`\n]+)`", text):
        line = text[:m.start()].count("\n") + 1
        for nm in re.findall(r"\b([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)+)(?=\(|\b)", m.group(1)):
            if SKIP.search(nm) or nm in seen:
                continue
            seen[nm] = (doc, line, resolve(nm))
bad = [(d, l, n) for n, (d, l, r) in seen.items() if r is None]
good = [(d, l, n, r) for n, (d, l, r) in seen.items() if r is not None]
print(f"{len(good)} resolved, {len(bad)} unresolved\n--- unresolved (first mention) ---")
for d, l, n in bad:
    print(f"{d}:{l}\t{n}")
print("--- resolved ---")
for d, l, n, r in good:
    print(f"{d}:{l}\t{n}\t-> {r}")
