"""The GGUF vocabulary of a Qwen byte-level BPE ``tokenizer.json``, read without transformers.

llama.cpp's ``gpt2`` tokenizer model needs: one token string per id up to the model's vocab size
(the embedding has more rows than the tokenizer has tokens; the gaps become ``[PAD{i}]``),
a type per token, the merges, and the special ids. ``tokenizer.ggml.pre = "qwen35"`` selects
Qwen3.5's pre-tokenizer regex inside llama.cpp.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import gguf

from clef_gguf.core.errors import ConversionError


@dataclass
class Vocab:
    tokens: list[str]
    types: list[int]
    merges: list[str]
    special_ids: dict[str, int]   # "bos"/"eos"/"pad"/"unk" -> id
    add_bos: bool
    add_eos: bool
    n_real: int                   # tokens the tokenizer defines (the rest is padding)


def _looks_special(text: str) -> bool:
    # llama.cpp's converter also makes <|...|> tokens CONTROL when the tokenizer did not flag them.
    return text.startswith("<|") and text.endswith("|>")


def _merge_strings(merges: list) -> list[str]:
    if not merges:
        return []
    if isinstance(merges[0], str):
        return list(merges)
    # Newer tokenizer.json stores pairs; GGUF keeps "a b" strings, so a literal space inside a
    # part is shifted to U+0120+... the way llama.cpp's SpecialVocab does.
    return [" ".join("".join(chr(ord(c) + 256) if c == " " else c for c in part) for part in pair)
            for pair in merges]


def read_vocab(tokenizer_json: Path, n_vocab: int, tokenizer_config: dict | None = None,
               model_config: dict | None = None) -> Vocab:
    try:
        spec = json.loads(Path(tokenizer_json).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ConversionError(f"cannot read {tokenizer_json}: {exc}") from None
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
        raise ConversionError(f"{tokenizer_json}: expected a BPE tokenizer with a vocab, "
                              f"got model type {model.get('type')!r}")
    by_id: dict[int, tuple[str, gguf.TokenType]] = {i: (t, gguf.TokenType.NORMAL) for t, i in model["vocab"].items()}
    for added in spec.get("added_tokens", []):
        kind = (gguf.TokenType.CONTROL if added.get("special") or _looks_special(added["content"])
                else gguf.TokenType.USER_DEFINED)
        by_id[int(added["id"])] = (added["content"], kind)
    top = max(by_id)
    if top >= n_vocab:
        raise ConversionError(f"tokenizer has token id {top} but the model's vocab_size is {n_vocab}")
    tokens, types = [], []
    for i in range(n_vocab):
        text, kind = by_id.get(i, (f"[PAD{i}]", gguf.TokenType.UNUSED))
        tokens.append(text)
        types.append(int(kind))

    ids_by_text = {text: i for i, (text, _) in by_id.items()}
    special: dict[str, int] = {}
    tcfg, mcfg = tokenizer_config or {}, model_config or {}
    for role in ("bos", "eos", "pad", "unk"):
        value = tcfg.get(f"{role}_token")
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str) and value in ids_by_text:
            special[role] = ids_by_text[value]
        elif isinstance(mcfg.get(f"{role}_token_id"), int):
            special[role] = mcfg[f"{role}_token_id"]
    # Without a configured BOS llama.cpp would default to id 11 (","); Qwen's own GGUFs name
    # <|endoftext|> instead. It is never inserted: add_bos_token stays false below.
    if "bos" not in special and "<|endoftext|>" in ids_by_text:
        special["bos"] = ids_by_text["<|endoftext|>"]
    # Qwen's ByteLevel post-processor adds nothing; llama.cpp must not add a BOS either.
    post = spec.get("post_processor") or {}
    adds = post.get("type") in ("TemplateProcessing", "RobertaProcessing", "BertProcessing")
    return Vocab(tokens=tokens, types=types, merges=_merge_strings(model.get("merges") or []),
                 special_ids=special, add_bos=bool(adds and tcfg.get("add_bos_token", False)),
                 add_eos=False, n_real=len(by_id))


def add_to_writer(writer: gguf.GGUFWriter, vocab: Vocab) -> None:
    writer.add_string("tokenizer.ggml.model", "gpt2")
    writer.add_string("tokenizer.ggml.pre", "qwen35")
    writer.add_array("tokenizer.ggml.tokens", vocab.tokens)
    writer.add_array("tokenizer.ggml.token_type", vocab.types)
    if vocab.merges:
        writer.add_array("tokenizer.ggml.merges", vocab.merges)
    keys = {"bos": "bos_token_id", "eos": "eos_token_id", "pad": "padding_token_id",
            "unk": "unknown_token_id"}
    for role, tid in vocab.special_ids.items():
        writer.add_uint32(f"tokenizer.ggml.{keys[role]}", tid)
    writer.add_bool("tokenizer.ggml.add_bos_token", vocab.add_bos)
    writer.add_bool("tokenizer.ggml.add_eos_token", vocab.add_eos)
