"""Ports for servers the harness starts: never handed out twice, inside the range the environment gives."""

from __future__ import annotations

import socket

import pytest

from kvroute import processes
from kvroute.processes import PORT_RANGE_ENV, StartupError, free_port_block, server_ports


def test_a_port_handed_out_and_not_yet_listened_on_is_not_handed_out_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(
        PORT_RANGE_ENV, "29000-29039"
    )  # forty ports: random blocks of two collide unless remembered
    bases = [free_port_block(2) for _ in range(8)]
    ports = [base + offset for base in bases for offset in (0, 1)]
    assert len(set(ports)) == 16 and all(29000 <= port <= 29039 for port in ports)


def test_a_large_block_is_found_after_many_small_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    # The search alone: servers other tests of this worker keep (session fixtures) may hold any real port,
    # so which ports are busy is given here, two of them inside the range.
    busy = {29950, 31990}
    monkeypatch.setattr(processes, "port_free", lambda port, host="127.0.0.1": port not in busy)
    monkeypatch.setenv(PORT_RANGE_ENV, "29900-31999")
    for _ in range(100):
        free_port_block(1)
    base = free_port_block(2000)
    assert 29900 <= base and base + 2000 <= 32000
    assert not busy & set(range(base, base + 2000))


def test_a_crowded_range_is_given_up_on_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    share = server_ports()
    monkeypatch.setenv(PORT_RANGE_ENV, f"{share.stop - 100}-{share.stop - 1}")
    with socket.socket() as held:
        held.bind(("127.0.0.1", share.stop - 50))  # no block of 60 fits beside it
        held.listen()
        with pytest.raises(StartupError, match="no block of 60 free ports"):
            free_port_block(60)


def test_the_environment_gives_each_worker_its_own_range(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PORT_RANGE_ENV, "21000-21999")
    assert server_ports() == range(21000, 22000)
    monkeypatch.delenv(PORT_RANGE_ENV)
    assert server_ports() == range(20000, 32768)
