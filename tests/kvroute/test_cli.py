"""The kvroute command: bad arguments and files are a message and exit status 2, never a traceback."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from kvroute.cli import main


@pytest.fixture(autouse=True)
def _keep_pytests_sigterm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(signal, "signal", lambda *_: None)  # main() installs its own handler


def test_check_config_reports_a_file_that_is_not_utf8(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bad.yaml"
    path.write_bytes(b"models: [{name: \xff}]\n")
    assert main(["check-config", str(path)]) == 2
    assert capsys.readouterr().err == f"{path}: not UTF-8 text: invalid start byte at byte 16\n"
