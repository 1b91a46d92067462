"""Convert a Clef release into a native ``clef`` GGUF with upstream llama.cpp's own converter
(``convert_hf_to_gguf.py`` + ``conversion/clef.py``: the joint head goes inside the GGUF), for
``clef-gguf bench --versus llama-server``.

    python benchmarks/upstream_convert.py LLAMA_CPP_DIR RELEASE OUT.gguf [--outtype q8_0]

One change to upstream's behaviour, and only for tokenizers it does not know: upstream picks the
pre-tokenizer by hashing the ids of a fixed text, and a random demo tokenizer (``clef-gguf demo``)
matches no known hash, so upstream refuses it. We pin ``qwen35``, the pre-tokenizer our own
converter writes and the one upstream picks for the real Qwen3.5 tokenizer. A known tokenizer
keeps upstream's own answer. Every tensor, key and the head's folding stay upstream's.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("llama_cpp", type=Path, help="the llama.cpp source tree (holds convert_hf_to_gguf.py)")
    p.add_argument("release", type=Path, help="the Hugging Face release directory (with joint_head.*)")
    p.add_argument("out", type=Path, help="the native clef GGUF to write")
    p.add_argument("--outtype", default="q8_0", help="upstream's --outtype (default q8_0)")
    args = p.parse_args(argv)
    script = args.llama_cpp / "convert_hf_to_gguf.py"
    if not script.is_file():
        p.error(f"{script} not found: pass the llama.cpp source tree")
    # Upstream's converter imports its own gguf-py and its conversion package from its folder.
    sys.path[:0] = [str(args.llama_cpp / "gguf-py"), str(args.llama_cpp)]
    from conversion.base import TextModel

    known = TextModel.get_vocab_base_pre

    def pre_tokenizer(self, tokenizer) -> str:
        try:
            return known(self, tokenizer)
        except NotImplementedError:  # an unknown (random demo) tokenizer: Qwen3.5's regex
            return "qwen35"

    TextModel.get_vocab_base_pre = pre_tokenizer
    import convert_hf_to_gguf

    sys.argv = [str(script), str(args.release), "--outfile", str(args.out), "--outtype", args.outtype]
    convert_hf_to_gguf.main()
    return 0


if __name__ == "__main__":
    sys.exit(main())
