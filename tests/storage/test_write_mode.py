"""How a local save the caller waits for chooses between buffered and direct writes."""

from __future__ import annotations

import pytest

from goodput_ckpt.storage import write_mode
from goodput_ckpt.storage.write_mode import decide, pressure, should_write_direct, signals


@pytest.mark.parametrize(
    "cpu, memory, load, direct",
    [
        (3.0, 0.0, None, False),  # a quiet machine: the page cache is faster
        (96.0, 0.0, None, True),  # runnable tasks wait for the CPUs most of the time
        (10.0, 40.0, None, True),  # reclaim stalls: every page-cache page must be freed first
        (10.0, None, None, False),  # no memory figure
        (None, None, 3.0, True),  # no PSI: the load average per CPU stands in
        (None, None, 0.5, False),
        (None, None, None, False),  # nothing to go by: the default of a dedicated node
        (10.0, 0.0, 9.0, False),  # the load average counts only without CPU pressure
    ],
)
def test_decide(cpu, memory, load, direct):
    chosen, why = decide(cpu, memory, load)
    assert chosen is direct
    assert why


def test_pressure_reads_the_some_line_of_a_psi_file(tmp_path, monkeypatch):
    psi = tmp_path / "cpu.pressure"
    psi.write_text("some avg10=61.50 avg60=12.00 avg300=3.00 total=12345\nfull avg10=0.00 avg60=0.00\n")
    assert write_mode._some_avg10(str(psi)) == 61.5
    psi.write_text("some avg10=garbage\n")
    assert write_mode._some_avg10(str(psi)) is None
    assert write_mode._some_avg10(str(tmp_path / "missing")) is None


def test_the_machine_state_is_read_and_decided():
    cpu, memory, load = signals()
    for value in (cpu, memory, load):
        assert value is None or value >= 0
    assert (cpu is None) or (load is None)  # the load average only without CPU pressure
    assert cpu == pytest.approx(pressure("cpu"), abs=100) if cpu is not None else True
    direct, why = should_write_direct()
    assert isinstance(direct, bool) and why
