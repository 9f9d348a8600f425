"""Creates the tiny policy everything trains on locally: a randomly initialised Llama causal LM
plus the character tokenizer, saved as a standard Hugging Face model directory.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path

from rlfleet.char_tokenizer import EOS, PAD, save_char_tokenizer, vocabulary

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TinyModelConfig:
    hidden_size: int = 256
    """Width of the residual stream."""
    layers: int = 4
    """Transformer blocks."""
    heads: int = 4
    """Attention heads; must divide hidden_size."""
    kv_heads: int = 2
    """Key/value heads (grouped-query attention); must divide heads."""
    intermediate_size: int = 768
    """Width of each block's MLP."""
    max_positions: int = 512
    """Context length in tokens."""
    seed: int = 0
    """Seed of the random initialisation."""

    def validate(self) -> None:
        for name in ("hidden_size", "layers", "heads", "kv_heads", "intermediate_size", "max_positions"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.hidden_size % self.heads:
            raise ValueError(f"hidden_size ({self.hidden_size}) must be a multiple of heads ({self.heads})")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")


def create_tiny_model(out_dir: Path, config: TinyModelConfig = TinyModelConfig()) -> int:
    """Writes config.json, model.safetensors and the tokenizer files into `out_dir`.

    Returns the parameter count. Refuses a directory that holds anything, so no file of another (a
    checkpoint, a tokenizer) is ever overwritten.
    """
    config.validate()
    out_dir = Path(out_dir)
    if (out_dir / "config.json").exists():
        raise FileExistsError(f"{out_dir} already holds a model (config.json); choose another --out or remove it")
    if out_dir.is_dir() and any(out_dir.iterdir()):
        raise FileExistsError(f"{out_dir} is not an empty directory; choose another --out (a new or empty directory)")
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    vocab = vocabulary()
    hf_config = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.layers,
        num_attention_heads=config.heads,
        num_key_value_heads=config.kv_heads,
        max_position_embeddings=config.max_positions,
        tie_word_embeddings=True,
        pad_token_id=vocab[PAD],
        eos_token_id=vocab[EOS],
        bos_token_id=None,
    )
    torch.manual_seed(config.seed)
    model = LlamaForCausalLM(hf_config).float()
    model.generation_config = GenerationConfig(eos_token_id=vocab[EOS], pad_token_id=vocab[PAD])
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir))
    save_char_tokenizer(out_dir, model_max_length=config.max_positions)
    (out_dir / "rlfleet_tiny.json").write_text(json.dumps(asdict(config), indent=2) + "\n")
    params = sum(p.numel() for p in model.parameters())
    logger.info("wrote a %d-parameter Llama model to %s", params, out_dir)
    return params
