"""The decoder and what runs it: config and traits, layers, ops (reference and CUDA), KV cache, one forward pass (batch), CUDA graphs (runner), memory plans and layer placement."""
