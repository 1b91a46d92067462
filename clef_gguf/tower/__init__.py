"""The language tower: final hidden states of every prompt token, whichever backend runs it.

``protocol`` is what the runtime sees (``LanguageTower``); ``cache`` holds what can be reused;
``llama`` the thin llama.cpp wrappers, ``llama_tower`` and ``llama_packed`` the llama.cpp tower,
``packing`` its policy and state layouts; ``nvfp4`` the PyTorch backend for NVFP4 checkpoints.
Imports nothing above ``pipeline``: the loader passes in placements and memory budgets."""
