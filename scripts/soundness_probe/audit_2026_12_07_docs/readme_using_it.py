# ruff: noqa  (the README snippet is kept verbatim, as a user would paste it)
import jax.numpy as jnp
from models import load_pretrained
from models.generate import generate
from certattn_jax import CertPolicy, summarize

m = load_pretrained("smollm2", dtype=jnp.float32)        # or an HF dir, a .gguf, a converted checkpoint
ids = m.tokenizer.encode(m.tokenizer.apply_chat_template([{"role": "user", "content": "Hi!"}]))
out = generate(m.params, m.config, [ids], 64, eos_token_ids=m.tokenizer.eos_token_ids,
               cache_factory="certified", policy=CertPolicy(eps=0.05), record_steps=True)
print(m.tokenizer.decode(out.tokens[0]), summarize(out.step_records))
