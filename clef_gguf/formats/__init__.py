"""The files clef-gguf reads and writes, one module per format: a model directory and its manifest
(``files``), a fine-tune directory (``finetune_files``), a calibration (``calibration``), GGUF and
safetensors readers that refuse damaged files naming the field. Below every stage that opens them."""
