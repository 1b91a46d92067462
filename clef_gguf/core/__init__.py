"""The foundation every layer stands on: the error registry, the contract's fixed numbers (context
window, question types), the CPU count, the argparse value types and the optional-dependency check
(``deps``). Imports nothing of clef_gguf."""
