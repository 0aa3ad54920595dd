"""Tokenizer, chat template and incremental detokenizer.

The tokenizer comes from transformers (a folder's tokenizer files, or the vocabulary in a
GGUF's metadata, converted once and cached: models/loader.gguf_converted); the chat
template is rendered by transformers in a jinja2 sandbox.
"""
from __future__ import annotations

import json

from sluice.chat_templates import END_OF_TURN_TOKENS
from sluice.models.loader import ModelSource, gguf_converted, read_gguf_chat_template

# apply_chat_template's own arguments (and transformers' template variables it sets):
# chat_template_kwargs may not override them.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})


class Tokenizer:
    def __init__(self, hf_tokenizer, eos_token_ids: set[int]):
        self.hf = hf_tokenizer
        self.eos_token_ids = eos_token_ids
        self._token_text: dict[int, str] = {}

    @classmethod
    def load(cls, src: ModelSource, hf_config) -> "Tokenizer":
        from transformers import AutoTokenizer
        converted = gguf_converted(src) if src.is_gguf else None
        if converted is not None:
            tok = AutoTokenizer.from_pretrained(str(converted))
        elif src.is_gguf:
            tok = AutoTokenizer.from_pretrained(str(src.folder), gguf_file=src.path.name)
            if not getattr(tok, "chat_template", None):
                tok.chat_template = read_gguf_chat_template(src.path)
        else:
            tok = AutoTokenizer.from_pretrained(str(src.path))
        eos: set[int] = set()
        for source in (tok.eos_token_id, getattr(hf_config, "eos_token_id", None),
                       _generation_config_eos(src)):
            if isinstance(source, int):
                eos.add(source)
            elif isinstance(source, (list, tuple)):
                eos.update(int(t) for t in source)
        template = getattr(tok, "chat_template", None)
        if isinstance(template, str):
            check_template(template)
            vocab = tok.get_vocab()
            eos.update(vocab[t] for t in END_OF_TURN_TOKENS if t in vocab and t in template)
        return cls(tok, eos)

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def decode_stream(self, skip_special_tokens: bool = True):
        """(tokenizers' DecodeStream, the Rust tokenizer it steps with), or None: incremental
        decoding in Rust, ~2 us a token against ~16 for two decode() calls through
        transformers. Only where it gives what decode() gives: a fast tokenizer whose
        output transformers does not clean up (clean_up_tokenization_spaces)."""
        rust = getattr(self.hf, "_tokenizer", None)
        if getattr(self.hf, "clean_up_tokenization_spaces", True) or rust is None:
            return None
        try:
            from tokenizers import Tokenizer as RustTokenizer
            from tokenizers.decoders import DecodeStream
        except ImportError:  # tokenizers before 0.21
            return None
        if not isinstance(rust, RustTokenizer):
            return None
        return DecodeStream(skip_special_tokens=skip_special_tokens), rust

    def token_text(self, token_id: int) -> str:
        """One token's text on its own, special tokens shown (a logprob entry's
        decoded_token). Cached per id: a request for many logprobs names most of the
        vocabulary at every position, and decoding each again cost ~7 us (a step of four
        requests asking for all 49,152 took seconds)."""
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.hf.decode([token_id], skip_special_tokens=False)
        return text

    def token_texts(self, ids: list[int]) -> list[str]:
        """token_text of each id; the cache read in one pass where it has them all."""
        texts = list(map(self._token_text.get, ids))
        if None in texts:
            texts = [t if t is not None else self.token_text(i) for i, t in zip(ids, texts)]
        return texts

    def info(self, max_model_len: int) -> dict:
        """The tokenizer's configuration as vLLM's GET /tokenizer_info reports it (its
        tokenizer_config.json: the init arguments, the class, the chat template), with each
        special token's id beside it and the server's context length as model_max_length
        where the tokenizer's own is larger (often 1e30: unset). Paths on this machine
        (file names, where it was loaded from) are left out."""
        config = {k: _jsonable(v) for k, v in (getattr(self.hf, "init_kwargs", None) or {}).items()
                  if k not in _LOCAL_KEYS}
        config["tokenizer_class"] = type(self.hf).__name__
        for name, token in self.hf.special_tokens_map.items():
            config[name] = _jsonable(token)
            ids = self.hf.convert_tokens_to_ids(config[name])
            config[name.removesuffix("s") + "_ids" if isinstance(ids, list) else f"{name}_id"] = ids
        own = config.get("model_max_length")
        config["model_max_length"] = own if isinstance(own, int) and own <= max_model_len else max_model_len
        config["eos_token_ids"] = sorted(self.eos_token_ids)  # every id that ends a generation
        if self.chat_template:
            config["chat_template"] = self.chat_template
        return config

    @property
    def chat_template(self) -> str | None:
        return getattr(self.hf, "chat_template", None)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, continue_final_message: bool = False,
                            chat_template_kwargs: dict | None = None) -> str:
        """The conversation as the model's chat template renders it. continue_final_message:
        the last message (an assistant's, typically) is left open for the reply to
        continue, instead of a new turn (not with add_generation_prompt, vLLM's rule).
        chat_template_kwargs: extra variables for the template (e.g. Qwen3's
        enable_thinking), vLLM's field; none may be one of the template call's own arguments."""
        if not getattr(self.hf, "chat_template", None):
            raise ValueError("this model has no chat template; use generate() with a plain prompt")
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise ValueError("messages must be a list of {'role': ..., 'content': ...} dicts")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        if continue_final_message and not messages:
            raise ValueError("continue_final_message needs a final message to continue")
        extra = dict(chat_template_kwargs or {})
        reserved = sorted(set(extra) & RESERVED_TEMPLATE_KWARGS)
        if reserved:
            raise ValueError(f"chat_template_kwargs cannot set {', '.join(reserved)}: use the request's own fields")
        return self.hf.apply_chat_template(messages, tokenize=False, tools=tools,
                                           add_generation_prompt=add_generation_prompt,
                                           continue_final_message=continue_final_message, **extra)

    def encode_chat(self, messages: list[dict], **template_args) -> list[int]:
        # The rendered template already holds its special tokens (BOS included, if any).
        return self.encode(self.apply_chat_template(messages, **template_args), add_special_tokens=False)


def check_template(template: str) -> None:
    """ValueError, at load, for a chat template that does not compile (a syntax error would
    otherwise surface as a 400 on every chat request)."""
    import jinja2
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:  # transformers moved it: the first chat request finds out instead
        return
    try:
        _compile_jinja_template(template)
    except jinja2.TemplateError as e:
        line = f" (line {e.lineno})" if getattr(e, "lineno", None) else ""
        raise ValueError(f"the model's chat template does not compile{line}: {e}") from None


# init_kwargs that name this machine's files, not the tokenizer.
_LOCAL_KEYS = frozenset({"vocab_file", "merges_file", "tokenizer_file", "name_or_path", "is_local",
                         "local_files_only", "cache_dir", "gguf_file"})


def _jsonable(value):
    """init_kwargs as JSON: special tokens (AddedToken) by their text, as in
    tokenizer_config.json's plain form; anything else not JSON by its str()."""
    if hasattr(value, "content"):
        return value.content
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)


def _generation_config_eos(src: ModelSource):
    path = src.folder / "generation_config.json"
    if src.is_gguf or not path.is_file():
        return None
    return json.loads(path.read_text()).get("eos_token_id")


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text, one token at a time.

    Decoding single tokens is wrong for byte-level BPE (a multi-byte UTF-8 character can
    span tokens) and for SentencePiece (leading spaces depend on context), so each step
    decodes a short window [prefix_offset:] and emits only what extends the text of
    [prefix_offset:read_offset]. A window ending in U+FFFD is an incomplete character: wait.

    Where the tokenizer has one, tokenizers' DecodeStream runs the same algorithm in Rust
    (Tokenizer.decode_stream; the same text a token on SmolLM2's and Gemma 3's tokenizers,
    tests/unit/test_detokenizer.py). The offsets move as the windows would move them, so
    flush() and a stream that fails (decoding in Python from there on) go on from there.
    """
    CONTEXT = 5

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.ids = list(prompt_token_ids[-self.CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.stream = tokenizer.decode_stream(skip_special_tokens)
        if self.stream is not None:
            stream, rust = self.stream
            try:
                for t in self.ids:  # the prompt's last tokens as context: their text is not ours
                    stream.step(rust, t)
            except Exception:  # tokenizers refused them: windows decoded in Python
                self.stream = None

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=self.skip)

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        if self.stream is not None:
            stream, rust = self.stream
            try:
                text = stream.step(rust, token_id)
            except Exception:  # tokenizers refused the sequence: the windows below take over
                self.stream = None
            else:
                if text:
                    self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
                return text or ""
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset:])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return new_text[len(prefix_text):]
        return ""

    def flush(self) -> str:
        """At the end: whatever is still held back (a truly invalid byte sequence)."""
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.ids)
        return new_text[len(prefix_text):] if len(new_text) > len(prefix_text) else ""
