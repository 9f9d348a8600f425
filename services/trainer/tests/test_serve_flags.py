"""`rlfleet_trainer serve`'s flags: one per setting, a boolean setting as a switch."""

from __future__ import annotations

import pytest

from rlfleet.settings_flags import settings_from_flags
from rlfleet_trainer.__main__ import SERVE_FLAGS, build_parser
from rlfleet_trainer.config import TrainerSettings


def parse(argv: list[str]) -> TrainerSettings:
    parser = build_parser()
    return settings_from_flags(TrainerSettings, SERVE_FLAGS, parser.parse_args(["serve", *argv]), parser)


def test_boolean_settings_are_switches_that_are_off_unless_given() -> None:
    switches = {flag.field for flag in SERVE_FLAGS if flag.kind == "switch"}
    booleans = {name for name, field in TrainerSettings.model_fields.items() if field.annotation is bool}
    assert switches == booleans == {"mixed_precision", "activation_checkpointing", "keep_trained_groups"}
    assert all(TrainerSettings.model_fields[name].default is False for name in booleans)  # a switch only turns on
    default = parse([])
    assert not default.mixed_precision and not default.activation_checkpointing
    on = parse(["--mixed-precision", "--activation-checkpointing", "--grpc-port", "50123"])
    assert on.mixed_precision and on.activation_checkpointing and on.grpc_port == 50123


def test_a_switch_takes_no_value(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parse(["--mixed-precision", "true"])
    assert exc.value.code == 2
    assert "unrecognized arguments: true" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--http-port", "70000"], "http_port (--http-port '70000')"),
        (["--grpc-port", "-1"], "grpc_port (--grpc-port '-1')"),
        (["--grpc-port", "50123", "--http-port", "50123"], "grpc_port and http_port are both 50123"),
    ],
)
def test_ports_are_checked_before_anything_binds(
    argv: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        parse(argv)
    assert exc.value.code == 2
    assert named in capsys.readouterr().err


def test_both_ports_may_be_left_to_the_system() -> None:
    settings = parse(["--grpc-port", "0", "--http-port", "0"])
    assert (settings.grpc_port, settings.http_port) == (0, 0)
