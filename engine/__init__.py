"""agent-infer: a small, fast LLM inference engine."""
