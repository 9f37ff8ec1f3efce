"""Tokenizer: encode/decode, special tokens, chat templates, save/load, GGUF and HF-dir construction.

A tiny byte-level BPE trained in-process covers the mechanics; the SmolLM2 GGUF tests (slow) pin
known ids of the real vocabulary. Parity with transformers lives in test_parity_hf.py.
"""

import json

import gguf
import pytest
from tokenizers import Tokenizer as TkTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from models import pretrained as pre
from models.gguf_loader import open_gguf
from models.tokenizer import Tokenizer

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEXTS = ["hello world", "12345 and 3.14159", "naïve café 日本語 🙂", "def f(x):\n\tif x:\n        return 1\n",
         "<|im_start|>user\nHi<|im_end|>\n", "  two  spaces\n\n", ""]


@pytest.fixture(scope="module")
def backend():
    tk = TkTokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = ["hello world, the quick brown fox jumps over the lazy dog 0123456789",
              "def f(x):\n    return x + 1\n", "naïve café"] * 20
    tk.train_from_iterator(corpus, trainer=trainer)
    return tk


@pytest.fixture
def tok(backend):
    return Tokenizer(backend, bos_token="<|im_start|>", eos_tokens=["<|im_end|>", "<|endoftext|>"],
                     chat_template=CHATML)


def test_encode_decode_roundtrip(tok):
    for text in TEXTS:
        ids = tok.encode(text)
        assert all(isinstance(i, int) for i in ids)
        assert tok.decode(ids) == text
    assert tok.encode("<|im_start|>user")[0] == tok.token_to_id("<|im_start|>")  # special matched whole
    assert tok.decode(tok.encode("<|im_start|>hi<|im_end|>"), skip_special_tokens=True) == "hi"
    assert tok.encode("7") == [tok.token_to_id("7")]
    assert len(tok.encode("123")) == 3  # digits are split individually


def test_special_ids_and_bos(tok, backend):
    assert tok.bos_token_id == 1 and tok.eos_token_ids == (2, 0)
    assert tok.encode("hi")[0] != 1
    assert tok.encode("hi", add_bos=True)[0] == 1
    with_bos = Tokenizer(backend, bos_token="<|im_start|>", add_bos_token=True)
    assert with_bos.encode("hi") == [1, *tok.encode("hi")]
    assert with_bos.encode("hi", add_bos=False) == tok.encode("hi")
    with pytest.raises(ValueError, match="not in the vocabulary"):
        Tokenizer(backend, eos_tokens=["<eos>"])


def test_chat_template(tok):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    want = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    assert tok.apply_chat_template(msgs, add_generation_prompt=False) == want
    assert tok.apply_chat_template(msgs) == want + "<|im_start|>assistant\n"
    no_template = Tokenizer(tok.backend)
    with pytest.raises(ValueError, match="no chat template"):
        no_template.apply_chat_template(msgs)
    # transformers-style helpers: raise_exception, tojson, {% generation %}, loop controls, bos/eos vars
    t = Tokenizer(tok.backend, bos_token="<|im_start|>", eos_tokens=["<|im_end|>"], chat_template=(
        "{{ bos_token }}{% for m in messages %}{% if m.role == 'bad' %}{{ raise_exception('bad role') }}{% endif %}"
        "{% if loop.index > 2 %}{% break %}{% endif %}{% generation %}{{ m | tojson }}{% endgeneration %}"
        "{% endfor %}{{ eos_token }}"))
    assert t.apply_chat_template([{"role": "user", "content": "é"}] * 3) == (
        '<|im_start|>{"role": "user", "content": "é"}{"role": "user", "content": "é"}<|im_end|>')
    with pytest.raises(Exception, match="bad role"):
        t.apply_chat_template([{"role": "bad", "content": ""}])


def test_chat_template_as_transformers_renders_it(tok):
    """An audit against transformers' apply_chat_template: `continue_final_message` was passed to the template and
    ignored (the turn closed), `tokenize=True` returned text, the template never saw `tools` / `documents`, a None
    content rendered as the word None, and an empty or malformed conversation rendered or failed unclearly."""
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Sure, "}]
    closed = tok.apply_chat_template(msgs, add_generation_prompt=False)
    assert closed.endswith("Sure, <|im_end|>\n")
    # the trailing space kept (the template keeps it), as transformers'; no generation prompt by default then
    assert tok.apply_chat_template(msgs, continue_final_message=True) == closed[: closed.rindex("Sure, ") + 6]
    blocks = [msgs[0], {"role": "assistant", "content": [{"type": "text", "text": "Sure, "}]}]
    t_blocks = Tokenizer(tok.backend, chat_template=(
        "{% for m in messages %}{% if m.content is string %}{{ m.content }}{% else %}"
        "{{ m.content[-1].text }}{% endif %}|{% endfor %}"))
    assert t_blocks.apply_chat_template(blocks, continue_final_message=True) == "Hi|Sure, "
    with pytest.raises(ValueError, match="exclusive"):
        tok.apply_chat_template(msgs, add_generation_prompt=True, continue_final_message=True)
    assert tok.apply_chat_template(msgs, tokenize=True) == tok.encode(tok.apply_chat_template(msgs), add_bos=False)
    t = Tokenizer(tok.backend, chat_template=(
        "{% if tools is not none %}[TOOLS]{% endif %}{% for m in messages %}{{ m.role }}{% if m.content is defined %}"
        ":{{ m.content }}{% endif %};{% endfor %}"))
    assert t.apply_chat_template([{"role": "user", "content": None}], add_generation_prompt=False) == "user;"
    assert t.apply_chat_template([{"role": "u", "content": "c"}], tools=[{"name": "f"}]) == "[TOOLS]u:c;"
    with pytest.raises(ValueError, match="non-empty list"):
        tok.apply_chat_template([])
    with pytest.raises(TypeError, match=r"messages\[1\] must be a dict"):
        tok.apply_chat_template([{"role": "user", "content": "a"}, "b"])


def test_decode_and_encode_refuse_what_is_no_token_or_text(tok):
    """decode(int(1.5)) silently decoded token 1, and a lone surrogate failed inside the backend unclearly."""
    import numpy as np

    ids = tok.encode("hello world")
    assert tok.decode(np.asarray(ids)) == tok.decode(ids) == "hello world"
    for bad in ([1.5], ["42"], np.asarray(ids, np.float32)):
        with pytest.raises(TypeError, match="token ids must be integers"):
            tok.decode(bad)
    with pytest.raises(ValueError, match="1-D"):
        tok.decode(np.asarray([ids, ids]))
    with pytest.raises(ValueError, match="position 2 .*lone surrogate"):
        tok.encode("ab\ud83d")
    with pytest.raises(TypeError, match="text must be a str"):
        tok.encode(b"bytes")


def test_save_load_roundtrip(tok, tmp_path):
    tok.save(tmp_path)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert cfg["chat_template"] == CHATML and cfg["eos_token"] == "<|im_end|>"
    back = Tokenizer.load(tmp_path)
    for text in TEXTS:
        assert back.encode(text) == tok.encode(text)
    assert (back.bos_token_id, back.eos_token_ids, back.add_bos_token) == (1, (2, 0), False)
    assert back.chat_template == CHATML
    with pytest.raises(FileNotFoundError):
        Tokenizer.load(tmp_path / "nothing")


def test_from_hf_dir_variants(backend, tmp_path):
    assert Tokenizer.from_hf_dir(tmp_path) is None  # no tokenizer.json: no tokenizer, no error
    backend.save(str(tmp_path / "tokenizer.json"))
    bare = Tokenizer.from_hf_dir(tmp_path)
    assert bare.bos_token_id is None and bare.eos_token_ids == () and bare.chat_template is None
    # AddedToken-dict special tokens, named template list, a chat_template.jinja file wins
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": {"__type": "AddedToken", "content": "<|im_start|>"}, "eos_token": "<|endoftext|>",
        "add_bos_token": True, "chat_template": [{"name": "tool_use", "template": "x"},
                                                 {"name": "default", "template": CHATML}]}))
    t = Tokenizer.from_hf_dir(tmp_path)
    assert t.bos_token_id == 1 and t.eos_token_ids == (0,) and t.add_bos_token and t.chat_template == CHATML
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    assert Tokenizer.from_hf_dir(tmp_path).apply_chat_template([{"role": "u", "content": "c"}]) == "c"
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="corrupt tokenizer"):
        Tokenizer.from_hf_dir(tmp_path)


def test_from_hf_dir_bos_from_post_processor(backend, tmp_path):
    from tokenizers import processors
    tk = TkTokenizer.from_str(backend.to_str())
    tk.post_processor = processors.TemplateProcessing(single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)])
    tk.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|im_start|>"}))
    t = Tokenizer.from_hf_dir(tmp_path)
    assert t.add_bos_token and t.encode("hi")[0] == 1 and t.encode("hi").count(1) == 1


def _write_tokenizer_gguf(path, backend, pre="smollm", model="gpt2", add_bos=False):
    vocab = backend.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [" ".join(m) for m in json.loads(backend.to_str())["model"]["merges"]]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model(model)
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_merges(merges)
    w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(add_bos)
    w.add_chat_template(CHATML)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_from_gguf_matches_source_tokenizer(backend, tmp_path):
    t = Tokenizer.from_gguf(open_gguf(_write_tokenizer_gguf(tmp_path / "t.gguf", backend)))
    for text in [*TEXTS, "the lazy dog 2024", "  0 x\t\t1"]:
        assert t.encode(text) == backend.encode(text, add_special_tokens=False).ids, text
        assert t.decode(t.encode(text)) == text
    assert (t.bos_token_id, t.eos_token_ids, t.add_bos_token, t.chat_template) == (1, (2,), False, CHATML)
    tb = Tokenizer.from_gguf(open_gguf(_write_tokenizer_gguf(tmp_path / "b.gguf", backend, add_bos=True)))
    assert tb.encode("hi")[0] == 1


def test_from_gguf_unsupported(backend, tmp_path):
    with pytest.raises(ValueError, match="pre-tokenizer 'qwen2'"):
        Tokenizer.from_gguf(open_gguf(_write_tokenizer_gguf(tmp_path / "a.gguf", backend, pre="qwen2")))
    with pytest.raises(ValueError, match="tokenizer model 'llama'"):
        Tokenizer.from_gguf(open_gguf(_write_tokenizer_gguf(tmp_path / "b.gguf", backend, model="llama")))


# ---- the real SmolLM2 vocabulary ---------------------------------------------------------------
@pytest.fixture(scope="module")
def smollm2_tok():
    return Tokenizer.from_gguf(open_gguf(pre.fetch_gguf("smollm2")))


@pytest.mark.slow
def test_smollm2_known_ids(smollm2_tok):
    t = smollm2_tok
    assert (t.vocab_size, t.bos_token_id, t.eos_token_ids, t.add_bos_token) == (49152, 1, (2,), False)
    assert t.encode("12345 and 3.14159") == [33, 34, 35, 36, 37, 284, 216, 35, 30, 33, 36, 33, 37, 41]
    assert t.encode("<|im_start|>user\nHi<|im_end|>\n") == [1, 4093, 198, 26843, 2, 198]
    # SmolLM2's tokenizer.json splits digits first (Digits(individual_digits=True)), like llama.cpp's
    # "smollm" pre-tokenizer: a whitespace run before a digit stays one piece.
    assert [t.id_to_token(i) for i in t.encode("  0")] == ["ĠĠ", "0"]
    for text in TEXTS:
        assert t.decode(t.encode(text)) == text
    out = t.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert out == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                   "<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
