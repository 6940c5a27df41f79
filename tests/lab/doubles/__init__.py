"""Test servers that stand in for SGLang and vLLM, one module each, rebuilt from their current public API."""
