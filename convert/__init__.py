"""Hugging Face Clef release -> clef-gguf model directory, and a random tiny release for tests."""
