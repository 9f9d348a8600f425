"""A command that cannot do its work ends with one line on stderr naming the path and status 2, not a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlfleet.cli import model
from rlfleet.cli.main import main


def test_an_output_path_under_a_file_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "afile").write_text("")
    assert main(["model", "init", "--out", str(tmp_path / "afile" / "model")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rlfleet: error: ") and "Not a directory" in err and str(tmp_path / "afile") in err
    assert "Traceback" not in err and err.count("\n") == 1


def test_a_path_the_user_may_not_write_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def denied(out: Path, *args: object) -> None:
        raise PermissionError(13, "Permission denied", str(out))

    monkeypatch.setattr(model, "create_tiny_model", denied)  # tests run as root, which any mode lets through
    assert main(["model", "init", "--out", str(tmp_path / "model")]) == 2
    err = capsys.readouterr().err
    assert err == f"rlfleet: error: [Errno 13] Permission denied: '{tmp_path / 'model'}'\n"
