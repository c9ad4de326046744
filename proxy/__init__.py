"""llm-diag-proxy: a transparent diagnostic reverse proxy for local LLM inference servers."""

__version__ = "0.1.0"
