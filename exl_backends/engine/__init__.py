"""The generation engine: jobs, scheduling, pages, sampling, constraints, tool calls, speculative decoding, text."""
