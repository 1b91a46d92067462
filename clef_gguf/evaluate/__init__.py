"""``clef-gguf eval`` and ``clef-gguf calibrate``: metrics on labelled records, quants side by side,
and temperatures fitted per quant.

One module per stage: ``records`` (the labelled JSONL), ``predict`` (one model over the records,
resumable), ``metrics`` (clef-finetune's definitions), ``agreement`` and ``stats`` (models side by
side), ``cost`` (size, memory and speed of each), ``report`` and ``plots`` (what a user reads),
``calibration`` (the CAL.json file the runtime applies), ``fit`` (fitting its temperatures),
``calibrate`` (the fit with its held-out check), ``demo`` (labelled demo records) and ``cli`` (the
commands).
"""
