"""Hugging Face Clef release -> clef-gguf model directory; ``synthetic``: made-up releases for the tests,
benchmarks and the demo."""
