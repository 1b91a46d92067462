"""The words of every capacity refusal, in one place: what a client reads when a request is over a limit.

Benchmark kits and SDKs tell "this engine cannot take this request" (recorded as unsupported) from "this
engine failed" (an error, retried) by conventional phrases in the message body: the OpenAI-style "maximum
context length", "context window", "options per choice"... Each text here carries one of ``KIT_PHRASES``
beside the numbers and the advice; the error classes and codes stay those of ``core.errors``. The words
of a question type's option counts are its registry entry's (``core.questions``: ``too_few``, ``too_many``).
"""

from __future__ import annotations

from clef_gguf.core import errors
from clef_gguf.core.questions import MAX_QUESTIONS, SCORE, question_type

# The Decision Index kit's capacity phrases (case-sensitive substrings of a 400/413/422 body).
KIT_PHRASES = ("options per choice", "a choice needs at least two options", "a score takes 2 to 10 levels",
               "the canvas holds", "maximum context length", "maximum model length",
               "longer than the maximum model length", "context window", "too many tokens")

_NUMBERS = {2: "two", 3: "three"}


def _window(window: int) -> str:
    return f"exceeds the model's context window (maximum context length {window} tokens)"


def context_window(needs: str, window: int) -> str:
    """The prompt is over the window: ``needs`` says how many tokens ("20294 tokens (20013 of them
    state)" or "more than 20000 tokens")."""
    return (f"the request needs {needs}, which {_window(window)}. Shorten the state, or ask for "
            "truncate_state to keep its first tokens")


def fixed_part(what: str, tokens: int, window: int) -> str:
    """The part before the state (the schema, the pictures) alone is over the window; the reference's
    words first."""
    return f"{what} requires {tokens} tokens before state; maximum is {window}: it {_window(window)}"


def too_few_options(qid: str, type_name: str, n: int) -> str:
    """Fewer options than strict allows a question of ``type_name``: the words its registry entry holds."""
    return _count(qid, type_name, n, few=True)


def too_many_options(qid: str, type_name: str, n: int) -> str:
    return _count(qid, type_name, n, few=False)


def _count(qid: str, type_name: str, n: int, *, few: bool) -> str:
    entry = question_type(type_name, field=f"questions.{qid}.type")
    words = entry.too_few if few else entry.too_many
    if entry.counts is None or words is None:
        raise errors.InternalError(f"a {entry.name} question has no option count to refuse", field=f"questions.{qid}")
    lo, hi = entry.counts
    return f"{qid}: " + words.format(lo=lo, hi=hi, lo_word=_NUMBERS.get(lo, lo), n=n)


def score_levels(n: int) -> str:
    assert SCORE.counts is not None and SCORE.too_many is not None
    lo, hi = SCORE.counts
    return SCORE.too_many.format(lo=lo, hi=hi, n=n)


def too_many_questions(n: int) -> str:
    return f"at most {MAX_QUESTIONS} questions per request (got {n}): the canvas holds {MAX_QUESTIONS} questions"


def request_size(refusal: str) -> str:
    """A body or a batch over the server's size limits: ``refusal`` with its numbers."""
    return f"{refusal}: too many tokens for one request"


def canvas(refusal: str, holds: str) -> str:
    """A picture or video over one of the media budgets: ``refusal`` with its numbers, ``holds`` the limit
    ("1003520 pixels", "64 images or video frames", "20000000 bytes per image")."""
    return f"{refusal}: the canvas holds {holds}"
