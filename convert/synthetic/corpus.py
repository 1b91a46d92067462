"""Built-in training text for the random release's byte-level BPE.

Deterministic and small: enough distinct word pairs for a few hundred merges. It mixes the
JSON-shaped text Clef prompts are made of with prose, digits, and non-ASCII (accents, combining
marks, CJK, emoji) so the byte-level and NFC paths of every tokenizer get exercised.
"""

CORPUS = """
The schema head reads every hidden state of the prompt and scores each option of each question.
A question can be noul, choice, or score; a choice has named options and a score has levels.
{"question":"is_spam","type":"noul","criteria":{"true":"the message is unsolicited","false":"it is not"}}
{"question":"topic","type":"choice","criteria":{"billing":"payment or invoice","shipping":"delivery","other":null}}
{"question":"urgency","type":"score","criteria":["not urgent","somewhat urgent","very urgent"]}
{"state":{"user":"alice","message":"My order 12345 has not arrived yet, can you check the tracking?"}}
{"state":"Refund requested for invoice #9981, amount 42.50 EUR, paid on 2024-03-17."}
The model answers in a single forward pass: no tokens are generated, only probabilities are read.
Instructions are rendered before the state, and the state is truncated when the prompt is too long.
Every option summary is scaled by the square root of the width before the field decoder runs.
The quick brown fox jumps over the lazy dog while the lazy dog sleeps under the old oak tree.
Numbers like 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 100, 1000 and 3.14159 are split into single digits.
Résumé, naïve café, façade, coöperate, Übermaß, smörgåsbord, señor, crème brûlée, déjà vu.
Combining marks: e\u0301 a\u0300 o\u0308 n\u0303 and the precomposed forms é à ö ñ should agree after NFC.
中文文本也需要被正确地切分。日本語のテキストも含まれています。한국어 문장도 있습니다.
Emoji and symbols: 😀 🚀 ✅ ❌ → ← ≤ ≥ ± € £ ¥ © ® ™ … “quoted” ‘single’ — dash – en-dash.
Code: def score(record): return {k: round(v, 4) for k, v in record.items() if v is not None}
Code: for (int i = 0; i < n; ++i) { total += weights[i] * values[i]; } // accumulate
Tabs\tand\tnewlines\nare whitespace; multiple   spaces    are kept by the byte-level encoder.
<think>hidden reasoning is not used by the decision head</think> but the tags are in the vocabulary.
Questions are answered in request order, and the probabilities of each question sum to one.
A support ticket about a broken laptop screen was escalated to the hardware team on Monday.
The customer asked whether the premium plan includes priority support and a dedicated manager.
Security alert: an unknown device signed in from a new location; was this you? Reply yes or no.
The agent called the search tool, then the calendar tool, and finally sent an email summary.
"""
