"""Request -> token ids and spans, exactly as the reference ``encode_record`` (spec §3).

The prompt is a list of text pieces, each tokenized on its own with the release
``tokenizer.json`` (never the whole prompt at once: merges across piece borders would change
the ids). Spans are end-exclusive token ranges of the question and option pieces.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import tokenizers

from clef_gguf.core import errors, refusals
from clef_gguf.core.limits import CONTEXT_WINDOW
from clef_gguf.pipeline.mediaprompt import MediaPrompt
from clef_gguf.pipeline.request import Question, Request

SYSTEM = ("Read the complete state and schema. Decide every field jointly. "
          "Each answer must be exactly one of that field's allowed options.")
PREFIX = f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\nSTATE:\n"
SCHEMA_HEADER = "\n\nSCHEMA FIELDS:\n"
OPTIONS_HEADER = "\nALLOWED OPTIONS:\n"
FIELD_END = "END FIELD\n"
SUFFIX = "\n<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nJOINT SCHEMA DECISIONS:"
DEFAULT_MAX_LENGTH = CONTEXT_WINDOW
# Pieces up to this many characters are cached (the fixed text, ids, option objects): the cache
# then holds at most 4096 x 256 characters, whatever clients send. Longer pieces are tokenized
# each time.
CACHED_PIECE_CHARS = 256
# Tokens past the window that a bounded state tokenization must still see, so that where the
# text was cut (inside a word, a merge, a special token) cannot reach the tokens that are kept.
CUT_MARGIN = 64

# Identifies this prompt layout in the response's audit block.
TEMPLATE_SHA256 = hashlib.sha256("\x00".join(
    [PREFIX, SCHEMA_HEADER, "\nFIELD {i}\nID: {id}\nTYPE: {type}\nINSTRUCTION: ", OPTIONS_HEADER,
     "OPTION {j}: ", "\n", FIELD_END, SUFFIX]).encode()).hexdigest()


def render(value: Any) -> str:
    """Strings raw; any other JSON value as compact JSON with sorted keys (Python's float repr)."""
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), sort_keys=True)


def bounded_encoding(tokenizer: tokenizers.Tokenizer, text: str, room: int) -> tuple[tokenizers.Encoding, bool]:
    """``(encoding, exact)``: ``text`` tokenized whole (``exact``) or, when it is longer than ``room``
    tokens, a prefix of it whose first ``room`` tokens are those of the whole text (``CUT_MARGIN``
    more are seen past them). The prefix grows 4x a try from ~4 characters a token, so a huge text
    costs a bounded prefix. The state's ids (``Encoder.state_ids``) and their characters
    (``evidence_spans.state_offsets``) both come from here, so they always agree."""
    chars = max(4096, 4 * (room + CUT_MARGIN))  # ~4 characters a token in most text
    while len(text) > chars:
        encoding = tokenizer.encode(text[:chars], add_special_tokens=False)
        if len(encoding.ids) > room + CUT_MARGIN:
            return encoding, False
        chars *= 4
    return tokenizer.encode(text, add_special_tokens=False), True


def option_text(option_id: str, description: Any) -> str:
    obj = {"option_id": option_id}
    if description is not None:
        obj["description"] = description
    return render(obj)


@dataclass(frozen=True)
class Encoded:
    ids: np.ndarray  # int32 [T]
    question_spans: tuple[tuple[int, int], ...]
    option_spans: tuple[tuple[int, int], ...]  # all options, question order then option order
    option_counts: tuple[int, ...]
    types: tuple[int, ...]
    state_tokens: int  # state tokens kept in the prompt
    prefix_tokens: int  # the fixed system prefix: the prompt is [prefix][state][schema + suffix]
    truncated: bool  # True only when the caller asked for truncation and it happened
    # Images and videos: their ids open the state segment (right after the prefix, as the reference
    # places them); ``media`` says where their embeddings go and every token's M-RoPE position.
    media: MediaPrompt | None = None
    media_tokens: int = 0  # the pictures' ids at the start of the state segment

    @property
    def n_tokens(self) -> int:
        return int(self.ids.shape[0])

    def option_token_ids(self) -> np.ndarray:
        """Token ids of every option span, concatenated in option order (the lexical rows' order)."""
        if not self.option_spans:
            return np.zeros(0, dtype=np.int32)
        return np.concatenate([self.ids[s:e] for s, e in self.option_spans])


@dataclass(frozen=True)
class Prepared:
    """A request validated and tokenized, ready for the tower (``Clef.prepare``)."""

    request: Request
    encoded: Encoded
    encode_ms: float
    # Which of a Clef's models answers (the base or a fine-tune, by name); "" : the one prepared on.
    model: str = ""


class Encoder:
    """Tokenizes pieces with HF ``tokenizers``; fixed pieces are tokenized once."""

    def __init__(self, tokenizer: tokenizers.Tokenizer, max_length: int = DEFAULT_MAX_LENGTH):
        if max_length < 1:
            raise errors.InvalidSetting("max_length must be positive", field="max_length")
        self.tokenizer = tokenizer
        self.max_length = max_length
        self._cached = lru_cache(maxsize=4096)(self._tokenize)
        self.prefix = self._ids(PREFIX)
        self.suffix = self._ids(SUFFIX)

    @classmethod
    def from_file(cls, path: str | Path, max_length: int = DEFAULT_MAX_LENGTH) -> Encoder:
        try:
            tok = tokenizers.Tokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises a bare Exception on bad files
            raise errors.CorruptModel(f"cannot read tokenizer {path}: {exc}", field="tokenizer") from None
        return cls(tok, max_length)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def _tokenize(self, text: str) -> tuple[int, ...]:
        return tuple(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def _ids(self, text: str) -> tuple[int, ...]:
        return self._cached(text) if len(text) <= CACHED_PIECE_CHARS else self._tokenize(text)

    def state_ids(self, text: str, room: int) -> tuple[list[int], bool]:
        """``(ids, exact)``: the state's ids, all of them (``exact``) or, for a state longer than
        ``room`` tokens, a prefix whose first ``room`` ids are those of the whole text. Only a
        bounded prefix of a huge state is tokenized: its tail would be refused or cut anyway."""
        encoding, exact = bounded_encoding(self.tokenizer, text, room)
        return encoding.ids, exact

    def _question_pieces(self, index: int, q: Question, out: list[int],
                         spans: list[tuple[int, int]], opt_spans: list[tuple[int, int]]) -> None:
        out += self._ids(f"\nFIELD {index}\nID: {q.id}\nTYPE: {q.type}\nINSTRUCTION: ")
        start = len(out)
        out += self._ids(render(q.instruction))
        if len(out) == start:
            raise errors.InvalidValue(f"{q.id}: the instruction renders to no tokens",
                                      field=f"questions.{q.id}.instructions")
        spans.append((start, len(out)))
        out += self._ids(OPTIONS_HEADER)
        for j, option in enumerate(q.options, 1):
            out += self._ids(f"OPTION {j}: ")
            start = len(out)
            out += self._ids(option_text(option.id, option.description))
            opt_spans.append((start, len(out)))
            out += self._ids("\n")
        out += self._ids(FIELD_END)

    def encode(self, request: Request, media_ids: tuple[int, ...] = ()) -> Encoded:
        """``media_ids``: the expanded media text's ids (``clef_gguf.media``), placed before the state
        and counted with the fixed part, as the reference does; they are part of the state segment."""
        schema: list[int] = list(self._ids(SCHEMA_HEADER))
        q_spans: list[tuple[int, int]] = []
        o_spans: list[tuple[int, int]] = []
        for i, question in enumerate(request.questions, 1):
            self._question_pieces(i, question, schema, q_spans, o_spans)

        fixed = len(self.prefix) + len(media_ids) + len(schema) + len(self.suffix)
        if fixed > self.max_length:
            what = "schema" if not media_ids else f"schema and media ({len(media_ids)} tokens)"
            raise errors.ContextTooLarge(
                refusals.fixed_part(what, fixed, self.max_length),
                field="questions" if not media_ids else ("images" if request.images else "videos"))
        room = self.max_length - fixed
        state, exact = self.state_ids(render(request.state), room)
        truncated = False
        if len(state) > room:
            if not request.truncate_state:
                needs = f"{fixed + len(state)} tokens ({len(state)} of them state)" if exact else \
                    f"more than {fixed + len(state)} tokens"
                raise errors.ContextTooLarge(refusals.context_window(needs, self.max_length), field="state")
            state = state[:room]
            truncated = True

        offset = len(self.prefix) + len(media_ids) + len(state)
        ids = np.fromiter((*self.prefix, *media_ids, *state, *schema, *self.suffix), dtype=np.int32,
                          count=fixed + len(state))
        shift = lambda spans: tuple((s + offset, e + offset) for s, e in spans)  # noqa: E731
        return Encoded(
            ids=ids,
            question_spans=shift(q_spans),
            option_spans=shift(o_spans),
            option_counts=tuple(len(q.options) for q in request.questions),
            types=tuple(q.type_index for q in request.questions),
            state_tokens=len(media_ids) + len(state),
            prefix_tokens=len(self.prefix),
            truncated=truncated,
            media_tokens=len(media_ids),
        )
