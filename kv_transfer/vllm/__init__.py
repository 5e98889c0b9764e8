"""vLLM integration: one module per pinned vLLM version (``v0_32``), later our own connector."""
