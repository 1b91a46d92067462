"""The language tower: final hidden states of every prompt token, whichever backend runs it.

``protocol`` is what the runtime sees (``LanguageTower``); ``cache`` holds what can be reused;
``schedule`` decides what is restored and what decoded, over the ``Sequences`` each backend gives;
``llama`` the thin llama.cpp wrappers, ``llama_tower`` the llama.cpp tower and ``llama_packed`` its
packed decoder, ``packing`` its policy and state layouts; ``nvfp4`` the PyTorch backend for NVFP4
checkpoints.
Imports nothing above ``pipeline``: the loader passes in placements and memory budgets."""
