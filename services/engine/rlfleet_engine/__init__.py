"""rlfleet CPU engine: SGLang HTTP API over a Hugging Face causal LM."""
