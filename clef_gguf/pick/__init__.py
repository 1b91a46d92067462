"""Which model on this machine, and getting it: ``clef-gguf pick`` (the machine's profile, the speed probe,
an eval's measured quality), ``pull`` and ``list``. An application over the catalog (``clef_gguf.models``): the
probe builds towers (``convert``) and times them (``tower``, ``heads``, ``vision``), which loading a model
never needs."""
