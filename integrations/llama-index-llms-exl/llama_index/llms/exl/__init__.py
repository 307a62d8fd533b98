from llama_index.llms.exl.base import Exl

__all__ = ["Exl"]
