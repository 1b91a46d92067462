"""``python -m clef_gguf.server ...``: the same as ``clef-gguf serve ...``."""

import sys

from clef_gguf.server.app import main

sys.exit(main())
