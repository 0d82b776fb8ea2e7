"""Requests, scheduling, sampling and the sync/async engines."""

from lserve.engine.llm_engine import LLM, LLMEngine
from lserve.engine.request_check import RequestError
from lserve.engine.sampling import SamplingParams
from lserve.engine.sequence import RequestOutput

__all__ = ["LLM", "LLMEngine", "RequestError", "RequestOutput", "SamplingParams"]
