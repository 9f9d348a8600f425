"""The policy's tokenizer as the orchestrator reads it: a run spec whose tokenizer cannot be found is refused
with a message that names model.path (the field the user most often set: model.tokenizer_path defaults to
it) and where a relative path led; prompts are encoded as the engine's own chat template path would."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from tokenizers.processors import TemplateProcessing

from rlfleet.errors import InvalidInput
from rlfleet_rollout.group_producer import RolloutContext
from rlfleet_rollout.prompt_tokenizer import load_chat_template, load_tokenizer, tokenizer_file


def test_a_missing_tokenizer_names_model_path_and_where_a_relative_path_led(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # the orchestrator's working directory
    with pytest.raises(InvalidInput) as refused:
        tokenizer_file(".rlfleet/demo/sft")
    message = str(refused.value)
    assert message.startswith("model.tokenizer_path: no tokenizer.json in '.rlfleet/demo/sft'")
    assert f"(here {tmp_path / '.rlfleet/demo/sft'})" in message
    assert "Unset, model.tokenizer_path is model.path: point model.path at" in message


def test_a_path_with_a_nul_byte_is_refused_naming_the_field() -> None:
    """Before, spelling out where the relative path led raised ValueError (embedded null byte): a 500."""
    with pytest.raises(InvalidInput, match=r"model\.tokenizer_path: no tokenizer\.json in 'tok\\x00'"):
        tokenizer_file("tok\x00")


def test_an_absolute_path_is_shown_as_given() -> None:
    with pytest.raises(InvalidInput, match=r"no tokenizer\.json in '/nonexistent'; the orchestrator"):
        tokenizer_file("/nonexistent")


def _bos_tokenizer(directory: Path, template: str | None = None, truncate_at: int = 0) -> Path:
    """A word-level tokenizer whose post-processor adds <s>, as Llama's and Gemma's do, saved to `directory`."""
    vocab = {"<s>": 0, "<unk>": 1, "user:": 2, "assistant:": 3, "1+2=": 4, "x": 5}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = WhitespaceSplit()
    tokenizer.add_special_tokens(["<s>"])  # found in text, as a template's {{ bos_token }} writes it
    tokenizer.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    if truncate_at:
        tokenizer.enable_truncation(max_length=truncate_at)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    if template is not None:
        (directory / "chat_template.jinja").write_text(template)
        (directory / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>"}))
    return directory


def test_a_rendered_prompt_has_one_bos_and_a_raw_one_gets_the_tokenizers(tmp_path: Path) -> None:
    """The template writes {{ bos_token }}; encoding its text with the tokenizer's special tokens gave two, where
    transformers' apply_chat_template (and slime) give one. The template is read from chat_template.jinja, where
    transformers saves it."""
    template = "{{ bos_token }}{% for m in messages %}user: {{ m.content }} {% endfor %}assistant:"
    path = str(_bos_tokenizer(tmp_path / "tok", template))
    tokenizer, render = load_tokenizer(path), load_chat_template(path)
    assert render("1+2=") == "<s>user: 1+2= assistant:"
    assert RolloutContext.encode(SimpleNamespace(tokenizer=tokenizer, render=render), render("1+2=")) == [0, 2, 4, 3]  # type: ignore[arg-type]
    assert RolloutContext.encode(SimpleNamespace(tokenizer=tokenizer, render=str), "1+2=") == [0, 4]  # type: ignore[arg-type]


def test_a_truncation_saved_in_tokenizer_json_does_not_cut_prompts(tmp_path: Path) -> None:
    tokenizer = load_tokenizer(str(_bos_tokenizer(tmp_path / "tok", truncate_at=3)))
    assert len(tokenizer.encode("x x x x x x").ids) == 7


HUB_TEMPLATE = (
    "{{ bos_token }}{% if messages[-1].content == '' %}{{ raise_exception('the prompt is empty') }}{% endif %}"
    "{% for m in messages[::-1] %}{% if m.role == 'user' %}{% set last = m %}{% break %}{% endif %}{% endfor %}"
    "Today: {{ strftime_now('%d %b %Y') }}\n"
    "{{ {'content': messages[-1].content, 'note': '<é & \"x\">'} | tojson(indent=1) }}\n"
    "{% for m in messages %}user: {{ m.content }} {% endfor %}"
    "{% generation %}{% if add_generation_prompt %}assistant:{% endif %}{% endgeneration %}"
)
"""What Hub templates use beyond plain Jinja (Qwen3: break; Llama 3.x: strftime_now; Gemma: raise_exception;
tool templates: tojson; assistant masks: generation)."""


def test_a_chat_template_renders_as_transformers_renders_it(tmp_path: Path) -> None:
    """The plain sandbox lacked loopcontrols and transformers' globals: {% break %} failed at submit and a
    template that dates its prompt fell back on a fixed date."""
    transformers = pytest.importorskip("transformers")
    path = _bos_tokenizer(tmp_path / "tok", HUB_TEMPLATE)
    reference = transformers.PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"), bos_token="<s>")
    reference.chat_template = HUB_TEMPLATE
    render = load_chat_template(str(path))
    for prompt in ("1+2=", "x <b>"):
        messages = [{"role": "user", "content": prompt}]
        expected = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert render(prompt) == expected
    assert '"note": "<é & \\"x\\">"' in render("1+2=")  # not HTML-escaped, not ASCII-escaped


def test_the_template_and_the_variables_are_those_transformers_loads_and_passes(tmp_path: Path) -> None:
    """The config's template won over chat_template.jinja, which transformers prefers; and the template saw only
    bos_token and eos_token: `tools is not none` was true (an empty tool list in every prompt), pad_token empty."""
    transformers = pytest.importorskip("transformers")
    template = (
        "{% if tools is not none %}[TOOLS]{{ tools }}[/TOOLS]{% endif %}{% if documents %}DOCS{% endif %}"
        "{% for m in messages %}user: {{ m.content }}{{ pad_token }}{% endfor %}assistant:"
    )
    path = _bos_tokenizer(tmp_path / "tok", template)
    config = {"bos_token": "<s>", "pad_token": "<pad>", "chat_template": "OLD {{ messages[0].content }}"}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    reference = transformers.AutoTokenizer.from_pretrained(str(path))
    expected = reference.apply_chat_template(
        [{"role": "user", "content": "1+2="}], tokenize=False, add_generation_prompt=True
    )
    assert load_chat_template(str(path))("1+2=") == expected == "user: 1+2=<pad>assistant:"


def test_special_tokens_named_only_in_special_tokens_map_are_rendered_as_transformers_renders_them(
    tmp_path: Path,
) -> None:
    """Many tokenizers name their bos and eos in special_tokens_map.json alone: {{ bos_token }} rendered '' where
    transformers renders '<s>', and every prompt differed from the model's own template."""
    transformers = pytest.importorskip("transformers")
    path = _bos_tokenizer(tmp_path / "tok", "{{ bos_token }}{% for m in messages %}[{{ m.content }}]{% endfor %}>")
    (path / "tokenizer_config.json").write_text("{}")  # the config names no token
    (path / "special_tokens_map.json").write_text(json.dumps({"bos_token": {"content": "<s>"}, "eos_token": "</s>"}))
    reference = transformers.AutoTokenizer.from_pretrained(str(path))
    expected = reference.apply_chat_template(
        [{"role": "user", "content": "1+2="}], tokenize=False, add_generation_prompt=True
    )
    assert load_chat_template(str(path))("1+2=") == expected == "<s>[1+2=]>"


def test_a_template_that_raises_is_refused_with_its_message(tmp_path: Path) -> None:
    render = load_chat_template(str(_bos_tokenizer(tmp_path / "tok", HUB_TEMPLATE)))
    with pytest.raises(InvalidInput, match="rendering the tokenizer's chat template failed: the prompt is empty"):
        render("")
    refusing = "{{ raise_exception('System role not supported') }}"
    with pytest.raises(InvalidInput, match="dataset.chat_template: .* failed: System role not supported"):
        load_chat_template(str(_bos_tokenizer(tmp_path / "refusing", refusing)))
