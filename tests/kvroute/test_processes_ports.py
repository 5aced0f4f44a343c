"""Ports for servers the harness starts: never handed out twice, inside the range the environment gives."""

from __future__ import annotations

import pytest

from kvroute.processes import PORT_RANGE_ENV, free_port_block, server_ports


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
    monkeypatch.setenv(PORT_RANGE_ENV, "27000-29099")  # a test worker's share, less than a third of it
    for _ in range(100):
        free_port_block(1)
    base = free_port_block(2000)
    assert 27000 <= base and base + 2000 <= 29100


def test_the_environment_gives_each_worker_its_own_range(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PORT_RANGE_ENV, "21000-21999")
    assert server_ports() == range(21000, 22000)
    monkeypatch.delenv(PORT_RANGE_ENV)
    assert server_ports() == range(20000, 32768)
