"""specserve: an OpenAI-compatible LLM inference server built around lossless speculative decoding."""

from specserve.request import CompletionOutput, RequestOutput, SamplingParams, TokenLogprob

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "TokenLogprob"]


def __getattr__(name: str):
    # LLM pulls in torch and transformers: import it on first use only
    if name == "LLM":
        from specserve.llm import LLM

        return LLM
    raise AttributeError(name)
