"""The kvroute command: bad arguments and files are a message and exit status 2, never a traceback."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from kvroute.cli import main


@pytest.fixture(autouse=True)
def _keep_pytests_sigterm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(signal, "signal", lambda *_: None)  # main() installs its own handler


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ("serve --config r.yaml --port 99999", "argument --port: '99999' is not a port (1-65535)"),
        ("fleet --port 99999", "argument --port: '99999' is not a port (1-65535)"),
        ("fleet --event-port 0", "argument --event-port: '0' is not a port (1-65535)"),
        ("fleet --instances -1", "argument --instances: '-1' is not a positive integer"),
        ("fleet --instances 0", "argument --instances: '0' is not a positive integer"),
        ("fleet --decode-tps 0", "argument --decode-tps: '0' is not a positive number"),
        ("fleet --prefill-tps nan", "argument --prefill-tps: 'nan' is not a positive number"),
        ("fleet --block-size x", "argument --block-size: 'x' is not an integer"),
        ("bench index --sizes abc", "argument --sizes: 'abc' is not an integer"),
        ("bench index --sizes 1000,0", "argument --sizes: '0' is not a positive integer"),
        ("bench index --sizes 1000,", "argument --sizes: '' is not an integer"),
        ("bench simulate --instances 0", "argument --instances: '0' is not a positive integer"),
        ("bench simulate --rate -2", "argument --rate: '-2' is not a positive number"),
        ("demo --turns 0", "argument --turns: '0' is not a positive integer"),
    ],
)
def test_bad_arguments_are_named_and_exit_2(
    argv: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(argv.split())
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_fleet_ports_past_65535_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["fleet", "--port", "65534", "--instances", "3"]) == 2
    assert "3 instances need ports up to 65536, past 65535" in capsys.readouterr().err


def test_a_fleet_tokenizer_that_cannot_be_loaded_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    absent = tmp_path / "absent"
    assert main(["fleet", "--tokenizer", str(absent)]) == 2
    assert capsys.readouterr().err == f"kvroute fleet: --tokenizer {absent}: not a directory\n"
    assert main(["fleet", "--tokenizer", str(tmp_path)]) == 2  # a directory without a tokenizer
    assert f"kvroute fleet: --tokenizer {tmp_path}: " in capsys.readouterr().err


def test_check_config_reports_a_file_that_is_not_utf8(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "bad.yaml"
    path.write_bytes(b"models: [{name: \xff}]\n")
    assert main(["check-config", str(path)]) == 2
    assert capsys.readouterr().err == f"{path}: not UTF-8 text: invalid start byte at byte 16\n"


@pytest.mark.parametrize(("environment", "seed"), [(None, "0"), ("7", "7")])
def test_the_fleets_hash_seed_follows_pythonhashseed_as_vllms_does(
    environment: str | None, seed: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvroute.cli import _parser

    if environment is None:
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    else:
        monkeypatch.setenv("PYTHONHASHSEED", environment)
    assert _parser().parse_args(["fleet"]).hash_seed == seed
    assert _parser().parse_args(["fleet", "--hash-seed", "3"]).hash_seed == "3"


def test_serve_and_fleet_help_name_the_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    serve = " ".join(capsys.readouterr().out.split())
    assert "port to listen on (default: 8000)" in serve
    assert "routing configuration (YAML) (default" not in serve  # required: no default to name
    with pytest.raises(SystemExit):
        main(["fleet", "--help"])
    assert "tokens per KV block (default: 32)" in " ".join(capsys.readouterr().out.split())
