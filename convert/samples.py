"""Sample requests: the default set of ``clef-gguf parity`` and ``quant-table``, and the calibration
prompts of ``convert --outtype nvfp4`` (all three question types, JSON and plain states, non-ASCII).
"""

from __future__ import annotations

from typing import Any

SAMPLE_REQUESTS: list[dict[str, Any]] = [
    {"state": "Invoice INV-2291 for $1,250.00 was due on 2026-10-01 and is still unpaid.",
     "questions": {
         "overdue": {"type": "noul", "instructions": "Is the invoice overdue?"},
         "action": {"type": "choice", "instructions": "What should happen next?",
                    "criteria": {"remind": "Send a payment reminder.", "escalate": None,
                                 "close": "Close the invoice."}}}},
    {"state": {"ticket": 48213, "text": "The app crashes when I upload a photo. Third time today!",
               "plan": "pro", "amount": 19.99},
     "questions": {
         "sentiment": {"type": "score", "instructions": "How frustrated is the customer?",
                       "criteria": ["calm", "annoyed", "angry", "furious"]},
         "team": {"type": "choice", "criteria": {"mobile": None, "billing": None, "web": None,
                                                 "infra": "Servers and storage"}},
         "bug": {"type": "noul"}}},
    {"state": "deploy 7f3a: 12 pods restarted, p95 latency 2.4s (SLO 800ms), error rate 4.1%. " * 12,
     "questions": {
         "rollback": {"type": "noul", "instructions": "Should the deploy be rolled back?"},
         "severity": {"type": "score", "criteria": ["sev4", "sev3", "sev2", "sev1"]}}},
    {"state": ["résumé reçu", "naïve café", {"lang": "fr", "score": 0.875}],
     "questions": {
         "language": {"type": "choice", "criteria": {"fr": "French", "en": "English",
                                                     "de": "German", "es": "Spanish"}},
         "complete": {"type": "noul", "criteria": {"true": "All fields present", "false": None}}}},
]

