"""One decision's stages that do not depend on which tower runs: ``request`` (validate), ``encode``
(the prompt and its spans), ``mediaprompt`` (pictures as embeddings at M-RoPE positions), ``lexical``
(the option rows), ``answer`` (probabilities into the SystemOne response)."""
