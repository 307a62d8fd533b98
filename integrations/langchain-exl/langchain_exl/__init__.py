"""LangChain integration of exl-backends: `ChatExl` (chat model) and `ExlLLM` (text completion)."""
from langchain_exl.chat_models import ChatExl
from langchain_exl.llms import ExlLLM

__all__ = ["ChatExl", "ExlLLM"]
