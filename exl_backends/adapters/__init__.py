"""transformers conventions (ExlForCausalLM, the EXL2 quantizer plugin) and the engines the LangChain and LlamaIndex adapters share."""
