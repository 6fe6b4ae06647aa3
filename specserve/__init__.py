"""specserve: declarative LLM serving with lossless speculative decoding."""

__version__ = "0.1.0"
