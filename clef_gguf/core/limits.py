"""Numbers the whole project shares, each defined once.

``CONTEXT_WINDOW`` is the reference implementation's prompt window in tokens
(docs/design/clef-reference.md §11): the default ``max_length``, the tower's context and the memory
model of ``pick`` all start from it. ``models/`` may import this module (tests/test_layout.py).
"""

CONTEXT_WINDOW = 16384
