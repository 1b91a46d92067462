"""A Hugging Face ``tokenizer.json`` rebuilt from a GGUF's ``tokenizer.ggml.*`` keys.

The inverse of ``gguf_vocab``: a native-clef GGUF carries the whole byte-level BPE (tokens, types,
merges), so a user holding only the GGUF still gets the tokenizer the runtime needs. The rebuilt
file has the layout of Qwen3.5's own ``tokenizer.json``: NFC normalizer; pre-tokenizer
Sequence[Split(regex, Isolated), ByteLevel(add_prefix_space=false, trim_offsets=false,
use_regex=false)]; ByteLevel post-processor and decoder; BPE without unk token or byte fallback.

Token types map back as gguf_vocab (and llama.cpp's converter) wrote them: NORMAL -> BPE vocab,
CONTROL -> added token marked special, USER_DEFINED -> added token not special, UNUSED
``[PAD{i}]`` -> the embedding's padding rows, which the original tokenizer never had (left out).
Every added token is ``normalized: false``, as in Qwen's tokenizers.

Not recoverable from a GGUF: an added ``<|...|>`` token that the original did not mark special
(both converters make it CONTROL). Encoding is unaffected (HF matches special and non-special
added tokens alike); only ``decode(skip_special_tokens=True)`` would also drop it.

Anything else that cannot be rebuilt exactly (another tokenizer model or pre-tokenizer, missing or
inconsistent merges, token/type mismatches, ids that HF would number differently) is refused with
a ``ConversionError`` naming the key.
"""

from __future__ import annotations

import json

import gguf
import tokenizers

from clef_gguf.core.errors import ConversionError
from clef_gguf.formats.gguf import field_value

MODEL, PRE = "tokenizer.ggml.model", "tokenizer.ggml.pre"
TOKENS, TYPES = "tokenizer.ggml.tokens", "tokenizer.ggml.token_type"
MERGES = "tokenizer.ggml.merges"
ADD_BOS, ADD_EOS = "tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_eos_token"

# The Split regex of each pre-tokenizer llama.cpp names. Qwen3.5 adds \p{M} to Qwen2's letter
# classes so combining marks (Hindi, Thai, decomposed accents) stay with their letters.
PRETOKENIZE_REGEX = {
    "qwen35": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
              r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
             r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}
BYTE_LEVEL = {"add_prefix_space": False, "trim_offsets": False, "use_regex": False}

NORMAL, CONTROL = int(gguf.TokenType.NORMAL), int(gguf.TokenType.CONTROL)
USER_DEFINED, UNUSED = int(gguf.TokenType.USER_DEFINED), int(gguf.TokenType.UNUSED)


def _field(reader: gguf.GGUFReader, key: str):
    try:
        value = field_value(reader, key)
    except UnicodeDecodeError as exc:  # contents() decodes every string as UTF-8
        raise ConversionError(f"key {key} holds a string that is not UTF-8 ({exc})") from None
    if value is None:
        raise ConversionError(f"key {key} is missing: the GGUF's vocabulary cannot be rebuilt")
    return value


def _list(reader: gguf.GGUFReader, key: str, kind: type) -> list:
    value = _field(reader, key)
    if not isinstance(value, list) or not value or not all(isinstance(v, kind) for v in value):
        raise ConversionError(f"key {key} is not a non-empty array of {kind.__name__}")
    return value


def _split_tokens(tokens: list[str], types: list[int]) -> tuple[dict[str, int], list[dict]]:
    """(BPE vocab, added tokens) from the per-id token strings and types."""
    alphabet = frozenset(tokenizers.pre_tokenizers.ByteLevel.alphabet())
    vocab: dict[str, int] = {}
    added: list[dict] = []
    seen: dict[str, int] = {}
    for i, (text, kind) in enumerate(zip(tokens, types)):
        if kind == UNUSED:
            if text != f"[PAD{i}]":
                raise ConversionError(f"{TYPES}[{i}] is UNUSED but {TOKENS}[{i}] is {text!r}, not "
                                      f"the converter's padding '[PAD{i}]': the token is lost")
            continue
        if kind not in (NORMAL, CONTROL, USER_DEFINED):
            name = gguf.TokenType(kind).name if kind in set(gguf.TokenType) else str(kind)
            raise ConversionError(f"{TYPES}[{i}] is {name} ({text!r}); a gpt2 vocabulary has only "
                                  "NORMAL, CONTROL, USER_DEFINED and UNUSED padding tokens")
        if text in seen:  # one string cannot have two ids in a tokenizer.json
            raise ConversionError(f"{TOKENS} holds {text!r} twice (ids {seen[text]} and {i})")
        seen[text] = i
        if kind == NORMAL:
            if not text or not set(text) <= alphabet:
                raise ConversionError(f"{TOKENS}[{i}] = {text!r} is not a byte-level BPE token "
                                      "(characters outside the ByteLevel alphabet)")
            vocab[text] = i
        else:
            added.append({"id": i, "content": text, "single_word": False, "lstrip": False,
                          "rstrip": False, "normalized": False, "special": kind == CONTROL})
    if not vocab:
        raise ConversionError(f"{TOKENS} has no NORMAL token: there is no BPE vocabulary")
    return vocab, added


def _merge_pairs(merges: list[str], vocab: dict[str, int]) -> list[list[str]]:
    # Byte-level tokens never hold a literal space, so "a b" splits in exactly one place. HF would
    # panic (not raise) on a merge whose result is missing, so every merge is checked here.
    pairs = []
    for k, merge in enumerate(merges):
        parts = merge.split(" ")
        if len(parts) != 2 or not all(parts):
            raise ConversionError(f"{MERGES}[{k}] = {merge!r} is not two tokens joined by a space")
        missing = [t for t in (parts[0], parts[1], parts[0] + parts[1]) if t not in vocab]
        if missing:
            raise ConversionError(f"{MERGES}[{k}] = {merge!r} needs {missing[0]!r}, which is not "
                                  f"a NORMAL token of {TOKENS}")
        pairs.append(parts)
    return pairs


def tokenizer_spec(reader: gguf.GGUFReader) -> dict:
    """The ``tokenizer.json`` object for the GGUF's vocabulary (checked, not yet loaded by HF)."""
    model = _field(reader, MODEL)
    if model != "gpt2":
        raise ConversionError(f"key {MODEL} is {model!r}; only llama.cpp's byte-level BPE ('gpt2') "
                              "can be rebuilt as a Qwen tokenizer.json")
    pre = _field(reader, PRE)
    if pre not in PRETOKENIZE_REGEX:
        raise ConversionError(f"key {PRE} is {pre!r}; the pre-tokenizer is known only for "
                              f"{', '.join(repr(p) for p in PRETOKENIZE_REGEX)}")
    tokens = _list(reader, TOKENS, str)
    types = _list(reader, TYPES, int)
    if len(types) != len(tokens):
        raise ConversionError(f"key {TYPES} has {len(types)} entries, {TOKENS} has {len(tokens)}")
    for key in (ADD_BOS, ADD_EOS):
        # Qwen's ByteLevel post-processor adds nothing; which template added a token is not stored.
        if field_value(reader, key):
            raise ConversionError(f"key {key} is true; a Qwen tokenizer adds no BOS/EOS, and the "
                                  "post-processor that did cannot be rebuilt")
    vocab, added = _split_tokens(tokens, types)
    merges = _merge_pairs(_list(reader, MERGES, str), vocab)
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": PRETOKENIZE_REGEX[pre]}, "behavior": "Isolated",
             "invert": False},
            {"type": "ByteLevel", **BYTE_LEVEL}]},
        "post_processor": {"type": "ByteLevel", **BYTE_LEVEL},
        "decoder": {"type": "ByteLevel", **BYTE_LEVEL},
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": "", "end_of_word_suffix": "", "fuse_unk": False,
                  "byte_fallback": False, "ignore_merges": False, "vocab": vocab, "merges": merges},
    }


def tokenizer_from_gguf(reader: gguf.GGUFReader) -> tokenizers.Tokenizer:
    """The HF tokenizer of a GGUF's vocabulary; ``ConversionError`` where it cannot be exact."""
    spec = tokenizer_spec(reader)
    try:
        tok = tokenizers.Tokenizer.from_str(json.dumps(spec, ensure_ascii=False))
    except Exception as exc:  # tokenizers raises a bare Exception on specs it rejects
        raise ConversionError(f"the GGUF's vocabulary does not load as a tokenizer: {exc}") \
            from None
    # HF numbers added tokens itself (after the BPE vocab, in list order) and ignores their "id";
    # a vocabulary with gaps or interleaved added tokens would come back renumbered.
    want = {**spec["model"]["vocab"], **{a["content"]: a["id"] for a in spec["added_tokens"]}}
    got = tok.get_vocab(with_added_tokens=True)
    if got != want:
        wrong = sorted((want[t], t, got.get(t)) for t in want if got.get(t) != want[t])
        tid, text, other = wrong[0] if wrong else (None, None, None)
        raise ConversionError(f"{TOKENS}: the rebuilt tokenizer numbers {text!r} {other}, not "
                              f"{tid} ({len(wrong)} token(s) differ), so its ids would not match "
                              "the model's embedding rows")
    return tok

