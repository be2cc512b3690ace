"""Engine integrations (Hugging Face transformers; vLLM and SGLang follow)."""
