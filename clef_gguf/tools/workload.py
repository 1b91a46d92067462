"""The synthetic requests every timing is made of: ``bench``, ``tune`` and the scripts under
``scripts/`` and ``benchmarks/`` build theirs here, so that their numbers are of one workload.

The request is a support ticket's state padded with whole sentences to about a number of prompt
tokens, and three questions (noul, 4-way choice, 5-level score); :func:`records` makes a bulk job's
worth of distinct ones, :func:`with_picture` adds a picture.
"""

from __future__ import annotations

SENTENCE = ("Customer 4471 reports that the March invoice was charged twice and asks for a refund "
            "of the duplicate payment before the end of the week. ")
QUESTIONS = {
    "refund": {"type": "noul", "instructions": "Should the duplicate charge be refunded?"},
    "team": {"type": "choice", "instructions": "Which team handles this?",
             "criteria": {"billing": "Payments, invoices and refunds", "support": None,
                          "fraud": "Suspicious activity", "sales": "Plans and upgrades"}},
    "urgency": {"type": "score", "instructions": "How urgent is it?",
                "criteria": ["none", "low", "medium", "high", "critical"]},
}
# Four question sets about one state (``bench --versus reuse`` and ``llama-server``).
REUSE_SETS = [{"refund": QUESTIONS["refund"]}, {"team": QUESTIONS["team"]},
              {"urgency": QUESTIONS["urgency"]},
              {"refund": QUESTIONS["refund"], "urgency": QUESTIONS["urgency"]}]


def sized_request(clef, tokens: int) -> dict:
    """A request whose prompt is as close to ``tokens`` as whole sentences allow (not over).

    Questions are dropped from the end (keeping one) while they alone exceed the target: small
    demo tokenizers spend several times more tokens on the same text than the release's.
    """
    names = list(QUESTIONS)
    while True:
        base = {"state": "", "questions": {k: QUESTIONS[k] for k in names}}
        fixed = clef.prepare(base).encoded.n_tokens
        if fixed <= tokens or len(names) == 1:
            break
        names.pop()
    per = max(1, len(clef.encoder.tokenizer.encode(SENTENCE, add_special_tokens=False).ids))
    n = max(0, (tokens - fixed) // per)
    while n > 0 and clef.prepare({**base, "state": SENTENCE * n}).encoded.n_tokens > tokens:
        n -= 1
    return {**base, "state": SENTENCE * n}


def records(clef, tokens: int, n: int, mixed: bool = False) -> list[dict]:
    """``n`` distinct requests of about ``tokens`` tokens, one question set: a bulk job's shape.
    ``mixed``: their states cut to 80-100 % of the length, so that no two prompts are as long."""
    base = sized_request(clef, tokens)
    out = []
    for i in range(n):
        state = base["state"].replace("4471", str(4471 + i), 1) or f"record {i}"
        if mixed:
            state = state[:round(len(state) * (0.8 + 0.2 * i / max(1, n - 1)))] + f" #{i}"
        out.append({**base, "state": state})
    return out


def with_picture(request: dict, size: int) -> dict:
    """``request`` with one ``size`` x ``size`` picture (seeded noise, PNG data URI): what the vision
    tower costs depends on its pixels' count, not on what they show."""
    import base64
    import io

    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(0).integers(0, 256, (size, size, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return {**request, "images": ["data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()]}
