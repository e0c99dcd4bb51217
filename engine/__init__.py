"""deepseek-fleet's inference engine for DeepSeek models."""

from engine.llm import LLM
from engine.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]
