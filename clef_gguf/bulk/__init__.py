"""``clef-gguf batch``: a file of requests in, a file of answers out, resumable.

``records`` reads the input (JSONL or Parquet) into ``Record``s, ``output`` writes and resumes the
answers, ``progress`` reports, ``local`` and ``ray_engine`` compute them, ``job`` runs the command
(``clef-gguf serve --engine ray-serve`` is the server's: ``server/ray_serve.py``).
"""
