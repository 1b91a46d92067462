"""The foundation every layer stands on: the error registry, the contract's fixed numbers (context
window, question types), the CPU count and the argparse value types. Imports nothing of clef_gguf."""
