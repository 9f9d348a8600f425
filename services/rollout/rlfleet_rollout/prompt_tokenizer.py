"""The policy's tokenizer (`tokenizer.json`, read with the `tokenizers` library: no transformers, no torch)
and its chat template (rendered with Jinja2 in a sandbox set up as transformers' apply_chat_template sets it up)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any, NoReturn

from jinja2 import TemplateError, nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.parser import Parser
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from rlfleet.errors import InvalidInput


def tokenizer_file(tokenizer_path: str) -> Path:
    """The tokenizer.json of a model or tokenizer directory; InvalidInput naming the field when absent.

    The message names model.path too, because the field is most often unset and so model.path (run_spec's
    `resolve`), and it spells out a relative path: it is this process's, resolved against its working
    directory, which a client on another machine (or in another directory) cannot guess."""
    path = Path(tokenizer_path) / "tokenizer.json"
    try:
        found = path.is_file()
    except OSError as exc:  # a name too long, a directory it may not search: not "not there"
        raise InvalidInput(f"model.tokenizer_path: cannot read {tokenizer_path!r}: {exc.strerror}") from None
    if not found:
        where = "" if os.path.isabs(tokenizer_path) else f" (here {os.path.abspath(tokenizer_path)})"
        raise InvalidInput(
            f"model.tokenizer_path: no tokenizer.json in {tokenizer_path!r}{where}; the orchestrator tokenizes "
            "prompts with it. Unset, model.tokenizer_path is model.path: point model.path at a Hugging Face model "
            "directory that has one, or model.tokenizer_path at a tokenizer's directory"
        )
    return path


def load_tokenizer(tokenizer_path: str) -> Tokenizer:
    """The tokenizer, without the truncation or padding a tokenizer.json may carry: a prompt cut to a saved
    max_length would lose its end (the generation prompt with it) where max_prompt_tokens cannot see it."""
    path = tokenizer_file(tokenizer_path)
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as exc:  # noqa: BLE001 - the library raises a bare Exception for unreadable files
        raise InvalidInput(f"model.tokenizer_path: cannot read {path}: {exc}") from exc
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return tokenizer


def load_chat_template(tokenizer_path: str) -> Callable[[str], str]:
    """The tokenizer's chat template as prompt -> rendered user turn, as transformers' apply_chat_template renders
    it: chat_template.jinja (where transformers saves it since 4.43, and which it prefers), else tokenizer_config.json
    `chat_template`; rendered with `tools` and `documents` None and every special token the config (or
    special_tokens_map.json) names.

    InvalidInput naming dataset.chat_template when the tokenizer has none: the run asked for one.
    """
    config = _json_file(Path(tokenizer_path) / "tokenizer_config.json")
    source = config.get("chat_template")
    jinja = Path(tokenizer_path) / "chat_template.jinja"
    if jinja.is_file():
        try:
            source = jinja.read_text(encoding="utf-8")
        except (OSError, ValueError) as exc:
            raise InvalidInput(f"model.tokenizer_path: cannot read {jinja}: {exc}") from exc
    if isinstance(source, list):  # named templates: the "default" one serves plain chat
        source = next((t.get("template") for t in source if isinstance(t, dict) and t.get("name") == "default"), None)
    if not isinstance(source, str) or not source:
        raise InvalidInput(
            f"dataset.chat_template: the tokenizer at {tokenizer_path!r} has no chat template "
            "(tokenizer_config.json `chat_template`, or chat_template.jinja); unset dataset.chat_template to send "
            "prompts as they are"
        )
    try:
        template = _jinja_environment().from_string(source)
    except TemplateError as exc:
        raise InvalidInput(f"dataset.chat_template: the tokenizer's chat template does not parse: {exc}") from exc
    # transformers passes its special_tokens_map: every token the config names (a template may use pad_token), or,
    # where the config does not, special_tokens_map.json (many tokenizers name their bos and eos there alone).
    named = {**_json_file(Path(tokenizer_path) / "special_tokens_map.json"), **config}
    specials: dict[str, Any] = {name: _token_text(named.get(name)) for name in _SPECIAL_TOKENS if name in named}
    specials.setdefault("bos_token", "")
    specials.setdefault("eos_token", "")
    if isinstance(extra := named.get("additional_special_tokens"), list):
        specials["additional_special_tokens"] = [_token_text(token) for token in extra]

    def render(prompt: str) -> str:
        try:
            return template.render(
                messages=[{"role": "user", "content": prompt}],
                tools=None,  # a template testing `tools is not none` rendered an empty tool list into every prompt
                documents=None,
                add_generation_prompt=True,
                **specials,
            )
        except TemplateError as exc:  # raise_exception's message included: the template says what it refused
            raise InvalidInput(f"dataset.chat_template: rendering the tokenizer's chat template failed: {exc}") from exc

    render("check")  # a template that cannot render fails at submit, not hours into the run
    return render


def _jinja_environment() -> ImmutableSandboxedEnvironment:
    """The Jinja environment transformers compiles chat templates in (`_compile_jinja_template`): Hub templates
    use {% break %}, raise_exception, strftime_now (Llama 3.x dates its system turn with it) and a tojson that
    does not escape HTML, and some mark assistant turns with {% generation %}. Without them a template fails to
    parse or renders differently from the prompts the model was trained on."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class _GenerationBlock(Extension):
    """{% generation %}...{% endgeneration %}: transformers tracks where assistant text is (for its assistant
    mask) and renders the body as it is; only prompts are rendered here, so only the rendering is kept."""

    tags = {"generation"}

    def parse(self, parser: Parser) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str) -> NoReturn:
    raise TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _json_file(path: Path) -> dict[str, Any]:
    """The JSON object in `path`, {} when there is none; InvalidInput naming the file when it cannot be read."""
    if not path.is_file():
        return {}
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise InvalidInput(f"model.tokenizer_path: cannot read {path}: {exc}") from exc
    if not isinstance(document, dict):
        raise InvalidInput(f"model.tokenizer_path: {path} holds a JSON {type(document).__name__}, not an object")
    return document


def _token_text(value: object) -> str:
    if isinstance(value, dict):  # an AddedToken serialized with its options
        return str(value.get("content", ""))
    return value if isinstance(value, str) else ""
