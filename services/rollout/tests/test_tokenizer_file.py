"""A run spec whose tokenizer cannot be found is refused with a message that helps: it names model.path (the
field the user most often set: model.tokenizer_path defaults to it) and where a relative path led."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlfleet.errors import InvalidInput
from rlfleet_rollout.prompt_tokenizer import tokenizer_file


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


def test_an_absolute_path_is_shown_as_given() -> None:
    with pytest.raises(InvalidInput, match=r"no tokenizer\.json in '/nonexistent'; the orchestrator"):
        tokenizer_file("/nonexistent")
