"""Measuring tools: ``bench`` (time per stage), ``bench_server`` (requests/s of ``serve``),
``parity`` (agreement with the transformers reference) and ``quant_table`` (every quant type)."""
