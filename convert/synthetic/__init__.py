"""Synthetic models: random releases at Clef's shapes (``tiny``: tests and the demo; ``big``: the 9B
shape for timing; ``head``: random joint heads; ``finetune_demo``: a random fine-tune; ``corpus``: the
text their tokenizers learn). They are fixtures, benchmarks and the demo, not conversions of anything;
tools and scripts import them by name."""
