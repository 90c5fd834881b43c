"""refengine: the user's entry point (CLI), the GGUF model layer, the tokenizer, synthetic models
and the NumPy reference engine that every faster path is checked against."""

__version__ = "0.1.0"
