"""specserve: declarative LLM serving with lossless speculative decoding."""

__version__ = "0.1.0"

# The vLLM-shaped offline API, imported on first use so `import specserve` stays light.
# SamplingParams is the vLLM-spelled door (specserve.compat); specserve.request holds the plain one.
_LAZY = {
    "LLM": "specserve.llm",
    "AsyncLLM": "specserve.llm",
    "CompletionOutput": "specserve.llm",
    "GenerationOutput": "specserve.llm",
    "SamplingParams": "specserve.compat",
    "StructuredOutputsParams": "specserve.request",
}
__all__ = ["__version__", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'specserve' has no attribute {name!r}")
