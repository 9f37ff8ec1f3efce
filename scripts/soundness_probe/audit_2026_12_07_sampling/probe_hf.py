"""Probe 5 (+ greedy ties, probe 2): greedy generate vs transformers' generate on the same random weights
(LlamaForCausalLM saved with save_pretrained, loaded with models.pretrained.load_pretrained(dtype=float32)).
3 prompts x 20 tokens, batch 1 and batched (ours: right-padded ragged batch; HF: left padding + attention mask),
dense and certified (eps 1e-6). Then a copy of the model whose lm_head rows 9 and 5 are equal (exact logit ties):
which index wins (torch.argmax and jnp.argmax both document the first)."""
import tempfile

import torch
import transformers
from common import POLICY, gen, jax, jnp, llama, np  # noqa: F401

from models import pretrained as pre

NEW = 20
HF_CFG = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0,
              initializer_range=0.3, attention_bias=False, mlp_bias=False, tie_word_embeddings=False,
              eos_token_id=None, bos_token_id=None, pad_token_id=None)


def hf_model(seed=0, tie_rows=None):
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**HF_CFG)).to(torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
        if tie_rows is not None:
            a, b = tie_rows
            model.lm_head.weight[a] = 5.0 * model.lm_head.weight[b]
            model.lm_head.weight[b] = model.lm_head.weight[a]
    return model


def hf_greedy(model, prompts, batched=False):
    gc = transformers.GenerationConfig(do_sample=False, max_new_tokens=NEW, min_new_tokens=NEW, eos_token_id=None,
                                       pad_token_id=0)
    if not batched:
        outs = []
        for p in prompts:
            with torch.no_grad():
                o = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                   generation_config=gc)
            outs.append(o[0, len(p):].tolist())
        return outs
    L = max(map(len, prompts))
    ids = torch.zeros(len(prompts), L, dtype=torch.long)
    mask = torch.zeros(len(prompts), L, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, L - len(p):] = torch.tensor(p)
        mask[i, L - len(p):] = 1
    with torch.no_grad():
        o = model.generate(ids, attention_mask=mask, generation_config=gc)
    return [o[i, L:].tolist() for i in range(len(prompts))]


def margins(m, prompt, toks):
    logits, _ = llama.forward(m.params, m.config, jnp.asarray([prompt + toks[:-1]], jnp.int32))
    last = np.sort(np.asarray(logits[0, len(prompt) - 1:]), axis=-1)
    return last[:, -1] - last[:, -2]


rng = np.random.default_rng(21)
PROMPTS = [rng.integers(0, 96, n).tolist() for n in (7, 19, 33)]
with tempfile.TemporaryDirectory() as d:
    model = hf_model()
    model.save_pretrained(d)
    m = pre.load_pretrained(d, dtype=jnp.float32)
print(f"loaded config: vocab {m.config.vocab_size}, head_dim {m.config.head_dim}, eos {m.config.eos_token_ids}, "
      f"tie {m.config.tie_word_embeddings}")
ref1 = hf_greedy(model, PROMPTS)
refb = hf_greedy(model, PROMPTS, batched=True)
print(f"HF batch-1 == HF left-padded batch: {[a == b for a, b in zip(ref1, refb)]}")
cert = POLICY.replace(eps=1e-6)
for mode, kw in (("dense", dict(cache_factory="dense")), ("certified", dict(cache_factory="certified", policy=cert))):
    alone = [gen.generate(m.params, m.config, [p], NEW, eos_token_ids=(), progress=False, **kw).tokens[0]
             for p in PROMPTS]
    batch = gen.generate(m.params, m.config, PROMPTS, NEW, eos_token_ids=(), progress=False, **kw).tokens
    for i, p in enumerate(PROMPTS):
        same = alone[i] == ref1[i]
        msg = ""
        if not same:
            k = next(j for j in range(NEW) if alone[i][j] != ref1[i][j])
            msg = f" first diff at token {k}: ours {alone[i][k]} HF {ref1[i][k]}"
        print(f"  {mode:9s} prompt {len(p):2d} tokens: ours(alone)==HF {same}, ours(batch)==HF {batch[i] == ref1[i]}"
              f"; min top-2 logit margin along HF's path {margins(m, p, ref1[i]).min():.3g}{msg}")
    print(f"  {mode} tokens (prompt 0): ours {alone[0]}\n  {' ' * len(mode)}            HF   {ref1[0]}")

# --- exact ties in the logits: lm_head rows 9 and 5 equal (5x row 5, so they often win)
with tempfile.TemporaryDirectory() as d:
    tmodel = hf_model(tie_rows=(9, 5))
    tmodel.save_pretrained(d)
    tm = pre.load_pretrained(d, dtype=jnp.float32)
ref_t = hf_greedy(tmodel, PROMPTS)
ours_t = [gen.generate(tm.params, tm.config, [p], NEW, eos_token_ids=(), progress=False).tokens[0] for p in PROMPTS]
for i in range(len(PROMPTS)):
    print(f"  tied rows (5, 9): ours {ours_t[i][:10]}... HF {ref_t[i][:10]}... equal {ours_t[i] == ref_t[i]}; "
          f"count of 5 / 9 in ours {ours_t[i].count(5)}/{ours_t[i].count(9)}, HF {ref_t[i].count(5)}/{ref_t[i].count(9)}")
# direct: select_next greedy on an exact tie
from models.sampling import select_next  # noqa: E402

row = jnp.asarray([[1.0, 3.0, 3.0, 0.0], [-jnp.inf, -jnp.inf, -jnp.inf, -jnp.inf], [jnp.nan, 1.0, 2.0, 0.0]])
print(f"  select_next greedy on [1,3,3,0] / all -inf / NaN row: "
      f"{np.asarray(select_next(row, jax.random.key(0), greedy=True, temperature=0., top_p=1.)).tolist()} "
      f"(torch.argmax: {[int(torch.argmax(torch.tensor(np.asarray(r)))) for r in row]})")
print(f"  select_next sampled, tiny top_p, on [1,3,3,0]: "
      f"{np.asarray(select_next(row[:1], jax.random.key(0), greedy=False, temperature=jnp.float32(1), top_p=jnp.float32(1e-6))).tolist()}")
