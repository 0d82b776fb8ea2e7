"""LServe: long-context LLM serving with unified block-sparse attention."""

__version__ = "0.1.0"
