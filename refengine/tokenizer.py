"""The tokenizer, built from the GGUF file's own vocabulary with the `tokenizers` library.

transformers' GGUF converter turns the `tokenizer.ggml.*` fields into a `tokenizers` object whose
ids equal llama.cpp's (docs/toolchain.md; tests/test_golden.py checks them against recorded
llama.cpp ids). Its own metadata reader imports torch, so we hand it the fields from our reader.
Conversion takes seconds (11 s for Gemma-3's SentencePiece vocabulary, whose merges are rebuilt), so
the result is cached as `tokenizer.json` keyed by the model file's identity; a cached tokenizer
loads without importing transformers.

BOS/EOS follow llama.cpp: `tokenizer.ggml.add_bos_token` when the file says, else BOS for a
SentencePiece (`llama`) vocabulary and none for a byte-level BPE (`gpt2`) one.
"""

from __future__ import annotations

import hashlib
import os

from tokenizers import Tokenizer as HFTokenizer

from .defaults import cache_dir
from .errors import UserError
from .gguf_file import read_gguf

# Control tokens llama.cpp also treats as end of generation, by their text.
EOG_TEXTS = {
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
    "<|return|>",
    "<|call|>",
    "<|eom_id|>",
}
CONTROL = 3

# GGUF key suffix -> the converter's name for it (transformers' GGUF_TOKENIZER_MAPPING).
_CONVERTER_KEYS = {
    "model": "tokenizer_type",
    "pre": "pre_tokenizer_type",
    "tokens": "tokens",
    "scores": "scores",
    "token_type": "token_type",
    "merges": "merges",
    "bos_token_id": "bos_token_id",
    "eos_token_id": "eos_token_id",
    "unknown_token_id": "unk_token_id",
    "padding_token_id": "pad_token_id",
    "add_space_prefix": "add_prefix_space",
}


class Tokenizer:
    def __init__(
        self,
        backend: HFTokenizer,
        *,
        bos_id: int | None,
        eos_id: int | None,
        add_bos: bool,
        add_eos: bool,
        eog_ids: frozenset[int],
    ):
        self.backend = backend
        self.bos_id, self.eos_id = bos_id, eos_id
        self.add_bos, self.add_eos = add_bos, add_eos
        self.eog_ids = eog_ids

    @property
    def n_vocab(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special: bool = True) -> list[int]:
        """Token ids of `text`; BOS/EOS added as llama.cpp does when `add_special`."""
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_special and self.add_bos and self.bos_id is not None:
            ids = [self.bos_id] + ids
        if add_special and self.add_eos and self.eos_id is not None:
            ids = ids + [self.eos_id]
        return ids

    def decode(self, ids) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=True)

    @classmethod
    def from_gguf(cls, path: str | os.PathLike) -> "Tokenizer":
        g = read_gguf(path)
        f = g.fields
        kind = f.get("tokenizer.ggml.model")
        if kind not in ("gpt2", "llama"):
            raise UserError(
                f"{path}: tokenizer model {kind!r} is not supported (gpt2 BPE and "
                "llama SentencePiece are); use --tokens to give token ids"
            )
        tokens, types = f.get("tokenizer.ggml.tokens"), f.get("tokenizer.ggml.token_type")
        if not isinstance(tokens, list) or not tokens:
            raise UserError(
                f"{path}: the file has no vocabulary (tokenizer.ggml.tokens); use "
                "--tokens to give token ids"
            )
        backend = _load_or_build(g)
        bos, eos = f.get("tokenizer.ggml.bos_token_id"), f.get("tokenizer.ggml.eos_token_id")
        eog = {
            i
            for i in (
                eos,
                f.get("tokenizer.ggml.eot_token_id"),
                f.get("tokenizer.ggml.eom_token_id"),
            )
            if i is not None
        }
        if types is not None:
            eog |= {i for i, t in enumerate(tokens) if types[i] == CONTROL and t in EOG_TEXTS}
        return cls(
            backend,
            bos_id=bos,
            eos_id=eos,
            add_bos=bool(f.get("tokenizer.ggml.add_bos_token", kind == "llama")),
            add_eos=bool(f.get("tokenizer.ggml.add_eos_token", False)),
            eog_ids=frozenset(int(i) for i in eog),
        )


def _identity_key(g) -> str:
    st = g.path.stat()
    ident = f"{g.path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    return hashlib.sha256(ident.encode()).hexdigest()[:24]


def _load_or_build(g) -> HFTokenizer:
    cached = cache_dir() / "tokenizers" / f"{_identity_key(g)}.json"
    if cached.is_file():
        return HFTokenizer.from_file(str(cached))
    backend = build_backend(g.fields)
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_suffix(".tmp")
    tmp.write_text(backend.to_str())
    tmp.replace(cached)
    return backend


def build_backend(fields: dict) -> HFTokenizer:
    """Convert a GGUF vocabulary to a `tokenizers` object (slow; cached by the caller)."""
    import logging

    logging.getLogger("transformers").setLevel(logging.ERROR)
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    td = {}
    for suffix, name in _CONVERTER_KEYS.items():
        value = fields.get(f"tokenizer.ggml.{suffix}")
        if value is not None:
            td[name] = value.tolist() if hasattr(value, "tolist") else value
    backend, _ = convert_gguf_tokenizer(fields["general.architecture"], td)
    return backend
