"""Loading and running models: ``model`` (one ``Clef``), ``backends`` (which tower opens a model's
files), ``finetunes`` (LoRA views of a loaded base), ``engine`` (many requests at once), ``flags``
(the load flags of every command)."""
