"""A character-level tokenizer for the tiny model, built with the `tokenizers` library.

Every printable ASCII character and the newline is one token, so arithmetic prompts tokenize the
same way in the engine, the trainer and any Hugging Face tool (`AutoTokenizer.from_pretrained`).
"""

from __future__ import annotations

import json
from pathlib import Path

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, EOS, UNK)
CHARACTERS = "\n" + "".join(chr(c) for c in range(32, 127))
# `role: content` lines; an assistant turn ends with the eos token, so a conversation re-rendered with a
# generated answer tokenizes to exactly the ids the model produced (eos included) followed by the new turn.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def vocabulary() -> dict[str, int]:
    """Token -> id: the special tokens first (pad=0, eos=1, unk=2), then one id per character."""
    tokens = [*SPECIAL_TOKENS, *CHARACTERS]
    return {tok: i for i, tok in enumerate(tokens)}


def save_char_tokenizer(out_dir: Path, model_max_length: int) -> None:
    """Writes tokenizer.json, tokenizer_config.json and special_tokens_map.json into `out_dir`."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    # BPE without merges splits every string into its characters; Fuse joins them back verbatim.
    core = Tokenizer(models.BPE(vocab=vocabulary(), merges=[], unk_token=UNK))
    core.add_special_tokens(list(SPECIAL_TOKENS))
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD,
        eos_token=EOS,
        unk_token=UNK,
        model_max_length=model_max_length,
        padding_side="left",
        chat_template=CHAT_TEMPLATE,
    )
    tokenizer.save_pretrained(str(out_dir))
    # transformers 5 writes its own class name; the portable name loads in 4.x (SGLang) and 5.x alike.
    config_path = Path(out_dir) / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config, indent=2) + "\n")
