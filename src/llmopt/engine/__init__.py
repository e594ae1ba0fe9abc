"""The engine layer: the only code that knows vLLM's flags and environment."""
