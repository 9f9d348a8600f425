"""rlfleet CPU engine: SGLang's HTTP API over a Hugging Face causal LM."""

__version__ = "0.1.0"
