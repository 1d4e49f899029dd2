"""deepserve: an inference engine and enterprise serving stack for the DeepSeek model family."""

from deepserve.config import EngineArgs
from deepserve.engine.outputs import CompletionOutput, Logprob, RequestOutput
from deepserve.entrypoints.llm import LLM
from deepserve.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "EngineArgs", "Logprob", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
