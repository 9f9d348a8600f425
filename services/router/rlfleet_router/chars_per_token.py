"""Characters per token of the engines' tokenizer, learned from the prompt tokens they report for text prompts.

The router sees a text prompt's characters, but an engine prefills and holds its tokens, and the ratio
depends on the tokenizer and the language: about 4 characters per token for English under common BPE
tokenizers, fewer for code or Chinese, one for a character-level tokenizer. A prompt's estimated tokens
price its prefill against requests in flight (cache_aware) and count in each engine's load, so a wrong
ratio makes the router value a cached prefix wrongly. The estimate starts at DEFAULT_CHARS_PER_TOKEN and
follows the engines' answers (SGLang's `meta_info.prompt_tokens`, OpenAI's `usage.prompt_tokens`) to
requests of one raw text prompt and one sample (not chat messages, which reach the engine inside a
template), weighted by their size, recent answers most.
"""

from __future__ import annotations

DEFAULT_CHARS_PER_TOKEN = 4.0
# Each answer scales the weight of the earlier ones (and of the default) by this: the estimate follows about
# the last 100 answers, so it settles within a few dozen and never rests on one odd prompt.
DECAY = 0.99
# The default counts as this many tokens of evidence at first: a few prompts' worth.
PRIOR_TOKENS = 1024.0
# Estimates are kept within these bounds, whatever an engine reports.
MIN_CHARS_PER_TOKEN = 0.25
MAX_CHARS_PER_TOKEN = 32.0


class CharsPerToken:
    """A running estimate of characters per token; `observe` each answer's prompt size, read `value`."""

    def __init__(self) -> None:
        self._chars = DEFAULT_CHARS_PER_TOKEN * PRIOR_TOKENS
        self._tokens = PRIOR_TOKENS

    @property
    def value(self) -> float:
        return min(MAX_CHARS_PER_TOKEN, max(MIN_CHARS_PER_TOKEN, self._chars / self._tokens))

    def observe(self, chars: int, tokens: int) -> None:
        """An engine reported `tokens` prompt tokens for a text prompt of `chars` characters."""
        if chars <= 0 or tokens <= 0:
            return
        self._chars = self._chars * DECAY + chars
        self._tokens = self._tokens * DECAY + tokens
