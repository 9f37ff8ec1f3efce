"""Tokenizer: a `tokenizers.Tokenizer` plus special tokens and a jinja chat template.

Sources: a GGUF file's metadata (`Tokenizer.from_gguf`, byte-level BPE as llama.cpp's `gpt2`
tokenizer model), a Hugging Face directory (`tokenizer.json` + `tokenizer_config.json`), or a
directory written by `Tokenizer.save` (the same two files, readable by transformers too).

`encode` adds BOS only when the model asks for it (`add_bos_token`); special tokens written in the
text (e.g. ``<|im_start|>``) are matched whole, as transformers and llama.cpp do.
"""

from __future__ import annotations

import datetime
import json
import operator
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"

# GGUF `tokenizer.ggml.token_type` values
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _gguf_pre_tokenizer(pre: str) -> tuple[Any, bool]:
    """(pre-tokenizer, BPE ignore_merges) for llama.cpp's `tokenizer.ggml.pre` name."""
    if pre == "smollm":
        return pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]), False
    if pre in ("gpt2", "default"):
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True), False
    if pre in ("llama-bpe", "llama3", "llama-v3"):
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]), True
    raise ValueError(f"unsupported GGUF pre-tokenizer {pre!r} (supported: smollm, gpt2, default, llama-bpe)")


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (used by some HF templates): renders its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> Any:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _compile_template(source: str) -> jinja2.Template:
    """Compile a chat template the way transformers does (sandboxed, trim/lstrip blocks)."""
    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env.from_string(source)


def _token_content(tok: Any) -> str | None:
    """A special token as `tokenizer_config.json` spells it: a string or an AddedToken dict."""
    if tok is None or isinstance(tok, str):
        return tok
    if isinstance(tok, dict):
        return tok.get("content")
    raise ValueError(f"cannot read special token {tok!r}")


def _cut_after_final_message(text: str, final: Any) -> str:
    """The rendered chat cut right after the last message's content (transformers' `continue_final_message`): its
    trailing whitespace kept where the template kept it; for a list of content blocks, the last text block."""
    if isinstance(final, (list, tuple)):
        texts = [b["text"] for b in final if isinstance(b, dict) and isinstance(b.get("text"), str)]
        if not texts:
            raise ValueError("continue_final_message: the last message has no text content block")
        final = texts[-1]
    if not isinstance(final, str) or final.strip() not in text:
        raise ValueError("continue_final_message: the last message's content does not appear in the rendered chat")
    at = text.rindex(final.strip())
    kept = final.lstrip()
    if text[at: at + len(kept)] == kept:  # the template kept the message's trailing whitespace
        return text[: at + len(kept)]
    return text[: at + len(final.strip())]


class Tokenizer:
    """Text <-> token ids, special tokens and the chat template of one model."""

    def __init__(self, backend: tokenizers.Tokenizer, *, bos_token: str | None = None,
                 eos_tokens: Sequence[str] = (), chat_template: str | None = None,
                 add_bos_token: bool = False) -> None:
        self.backend = backend
        self.bos_token = bos_token
        self.eos_tokens = tuple(eos_tokens)
        self.chat_template = chat_template
        self.add_bos_token = bool(add_bos_token)
        for tok in ([bos_token] if bos_token else []) + list(self.eos_tokens):
            if backend.token_to_id(tok) is None:
                raise ValueError(f"special token {tok!r} is not in the vocabulary")
        self._template: jinja2.Template | None = None

    # ---- ids -----------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        return None if self.bos_token is None else self.backend.token_to_id(self.bos_token)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return tuple(self.backend.token_to_id(t) for t in self.eos_tokens)

    @property
    def eos_token(self) -> str | None:
        return self.eos_tokens[0] if self.eos_tokens else None

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, idx: int) -> str | None:
        return self.backend.id_to_token(idx)

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids of `text`; BOS is prepended when `add_bos` (default: the model's `add_bos_token`)."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:  # a lone surrogate (e.g. from json.loads('"\\ud83d"')): no UTF-8 bytes
            raise ValueError(f"text holds a character with no UTF-8 encoding at position {e.start} "
                             f"({text[e.start]!r}, a lone surrogate): it cannot be tokenized") from None
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if (self.add_bos_token if add_bos is None else add_bos) and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids` (ints; a numpy/jax 1-D array works too). A float, a string or a nested sequence is refused
        (`int(1.5)` would silently decode token 1)."""
        if getattr(ids, "ndim", 1) != 1:
            raise ValueError(f"ids must be one sequence of token ids (1-D), got shape {getattr(ids, 'shape', None)}")
        flat = []
        for i in ids:
            try:
                flat.append(operator.index(i))
            except TypeError:
                raise TypeError(f"token ids must be integers, got {i!r} ({type(i).__name__})") from None
        return self.backend.decode(flat, skip_special_tokens=skip_special_tokens)

    # ---- chat ----------------------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool | None = None,
                            tokenize: bool = False, continue_final_message: bool = False,
                            tools: list[dict[str, Any]] | None = None, documents: list[dict[str, Any]] | None = None,
                            **kwargs: Any) -> str | list[int]:
        """Render `messages` ([{"role": ..., "content": ...}, ...]) with the model's jinja template: the text, or
        with `tokenize` its token ids. As transformers' method renders (the template sees `tools`, `documents`, the
        special tokens, and messages without their None-valued keys; `continue_final_message` leaves the last
        message open for the model to go on, its trailing whitespace kept where the template keeps it), except for
        two defaults: the generation prompt is added (unless the final message is continued) and the text returned
        unless asked otherwise. Other keywords reach the template as variables, as in transformers."""
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template")
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
        for i, m in enumerate(messages):
            if not isinstance(m, dict):
                raise TypeError(f"messages[{i}] must be a dict with 'role' and 'content', got {type(m).__name__}")
        if add_generation_prompt is None:
            add_generation_prompt = not continue_final_message
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt are exclusive: pass "
                             "add_generation_prompt=False to continue the last message")
        if self._template is None:
            self._template = _compile_template(self.chat_template)
        messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
        specials = {"bos_token": self.bos_token or "", "eos_token": self.eos_token or "", "pad_token": None,
                    "unk_token": None}
        text = self._template.render(messages=messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                     documents=documents, **{**specials, **kwargs})
        if continue_final_message:
            text = _cut_after_final_message(text, messages[-1].get("content"))
        return self.encode(text, add_bos=False) if tokenize else text

    # ---- persistence ---------------------------------------------------------------------------
    def config_dict(self) -> dict[str, Any]:
        """`tokenizer_config.json` contents (transformers-readable, plus our `eos_tokens`)."""
        return {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "eos_tokens": list(self.eos_tokens),
            "add_bos_token": self.add_bos_token,
            "add_eos_token": False,
            "chat_template": self.chat_template,
        }

    def save(self, directory: str | Path) -> None:
        """Write `tokenizer.json` and `tokenizer_config.json` into `directory` (created if needed)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(directory / TOKENIZER_FILE))
        (directory / TOKENIZER_CONFIG_FILE).write_text(json.dumps(self.config_dict(), indent=2, ensure_ascii=False))

    @classmethod
    def load(cls, directory: str | Path) -> Tokenizer:
        """Read a directory written by `save` (or any HF tokenizer dir); FileNotFoundError if absent."""
        tok = cls.from_hf_dir(directory)
        if tok is None:
            raise FileNotFoundError(f"{TOKENIZER_FILE} not found in {directory}")
        return tok

    @classmethod
    def from_hf_dir(cls, directory: str | Path) -> Tokenizer | None:
        """From a HF directory's `tokenizer.json` (+ `tokenizer_config.json`, `chat_template.jinja`).

        Returns None when the directory has no `tokenizer.json`.
        """
        directory = Path(directory)
        tok_path = directory / TOKENIZER_FILE
        if not tok_path.is_file():
            return None
        try:
            backend = tokenizers.Tokenizer.from_file(str(tok_path))
        except Exception as e:  # tokenizers raises plain Exception on bad JSON
            raise ValueError(f"corrupt tokenizer file {tok_path}: {e}") from None
        cfg: dict[str, Any] = {}
        cfg_path = directory / TOKENIZER_CONFIG_FILE
        if cfg_path.is_file():
            try:
                cfg = json.loads(cfg_path.read_text())
            except json.JSONDecodeError as e:
                raise ValueError(f"corrupt tokenizer config {cfg_path}: {e}") from None
        bos = _token_content(cfg.get("bos_token"))
        eos_tokens = cfg.get("eos_tokens") or ([_token_content(cfg["eos_token"])] if cfg.get("eos_token") else [])
        template = cfg.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        if (directory / CHAT_TEMPLATE_FILE).is_file():
            template = (directory / CHAT_TEMPLATE_FILE).read_text()
        if "add_bos_token" in cfg:
            add_bos = bool(cfg["add_bos_token"])
        else:  # e.g. LLaMA 3: the post-processor adds BOS
            bos_id = backend.token_to_id(bos) if bos else None
            with_special = backend.encode("a", add_special_tokens=True).ids
            add_bos = bos_id is not None and len(with_special) > 1 and with_special[0] == bos_id
        return cls(backend, bos_token=bos if bos and backend.token_to_id(bos) is not None else None,
                   eos_tokens=[t for t in eos_tokens if backend.token_to_id(t) is not None],
                   chat_template=template, add_bos_token=add_bos)

    @classmethod
    def from_gguf(cls, reader: Any) -> Tokenizer:
        """From a `gguf.GGUFReader`'s `tokenizer.ggml.*` metadata (byte-level BPE only)."""
        def meta(key: str, default: Any = None) -> Any:
            field = reader.get_field(key)
            return default if field is None else field.contents()

        model = meta("tokenizer.ggml.model")
        if model != "gpt2":
            raise ValueError(f"unsupported GGUF tokenizer model {model!r} (only byte-level BPE 'gpt2')")
        tokens: list[str] = meta("tokenizer.ggml.tokens") or []
        merges_raw: list[str] = meta("tokenizer.ggml.merges") or []
        if not tokens:
            raise ValueError("GGUF has no tokenizer.ggml.tokens")
        token_types: list[int] = meta("tokenizer.ggml.token_type") or [1] * len(tokens)
        merges = []
        for m in merges_raw:
            parts = m.split(" ")
            if len(parts) != 2:
                raise ValueError(f"malformed GGUF merge {m!r}: expected 'a b'")
            merges.append((parts[0], parts[1]))
        vocab = {t: i for i, t in enumerate(tokens)}
        if len(vocab) != len(tokens):
            raise ValueError("GGUF token list has duplicate tokens")
        pre, ignore_merges = _gguf_pre_tokenizer(meta("tokenizer.ggml.pre", "default"))
        backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges))
        backend.pre_tokenizer = pre
        backend.decoder = decoders.ByteLevel()
        special = [AddedToken(t, special=True, normalized=False)
                   for t, ty in zip(tokens, token_types, strict=True) if ty == _TOKEN_CONTROL]
        user = [AddedToken(t, special=False, normalized=False)
                for t, ty in zip(tokens, token_types, strict=True) if ty == _TOKEN_USER_DEFINED]
        backend.add_special_tokens(special)
        if user:
            backend.add_tokens(user)
        if backend.get_vocab_size(with_added_tokens=True) != len(tokens):
            raise ValueError("GGUF special tokens changed the vocabulary size")

        def tok(key: str) -> str | None:
            idx = meta(f"tokenizer.ggml.{key}_token_id")
            return None if idx is None or not 0 <= int(idx) < len(tokens) else tokens[int(idx)]

        eos = [t for t in (tok("eos"), tok("eot"), tok("eom")) if t is not None]
        return cls(backend, bos_token=tok("bos"), eos_tokens=list(dict.fromkeys(eos)),
                   chat_template=meta("tokenizer.chat_template"),
                   add_bos_token=bool(meta("tokenizer.ggml.add_bos_token", False)))
