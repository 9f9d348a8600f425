"""A weight load that names no directory (an empty or blank model_path) is refused up front, naming the field, on
both CPU engines: Path("") is the working directory, so the model core read the files there (and loaded them, if
it held a checkpoint), and the sim took "  " as a path."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry
from safetensors.torch import save_file
from zero_logits_backend import CharTokenizer, ZeroLogitsBackend

from rlfleet.errors import InvalidInput
from rlfleet_engine.config import EngineConfig
from rlfleet_engine.engine_core import EngineCore
from rlfleet_engine.http_app import create_app
from rlfleet_engine.sim_backend import SimEngineCore
from rlfleet_engine.weight_loading import read_safetensors_dir

BLANK = ["", "  "]


def ask_to_load(core: Any, path: str) -> tuple[Any, dict[str, Any]]:
    """The answer to a disk load from `path`, and /get_model_info after it."""
    with TestClient(create_app(core, CollectorRegistry())) as client:
        answer = client.post("/update_weights_from_disk", json={"model_path": path, "weight_version": "2"})
        return answer, client.get("/get_model_info").json()


@pytest.mark.parametrize("backend", ["model", "sim"])
@pytest.mark.parametrize("path", BLANK)
def test_a_disk_load_without_a_directory_is_refused_naming_model_path(backend: str, path: str) -> None:
    if backend == "sim":
        answer, info = ask_to_load(SimEngineCore(EngineConfig(model_path="/m"), CollectorRegistry()), path)
    else:
        core = EngineCore(EngineConfig(model_path="/m"), ZeroLogitsBackend(), CharTokenizer(), CollectorRegistry())  # type: ignore[arg-type]
        core.start()
        try:
            answer, info = ask_to_load(core, path)
        finally:
            core.stop()
    assert answer.status_code == 400
    body = answer.json()
    assert body["success"] is False and body["message"].startswith("Failed to update weights: model_path is ")
    assert (info["model_path"], info["weight_version"]) == ("/m", "default")


@pytest.mark.parametrize("path", BLANK)
def test_reading_weights_from_no_directory_never_reads_the_working_directory(
    path: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    save_file({"w": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InvalidInput, match="model_path is "):
        read_safetensors_dir(path)
