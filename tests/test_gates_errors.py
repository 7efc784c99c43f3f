"""The runner never says green by accident: every error path of ``python -m gates``.

Broken gate files make ``list`` fail, ``run --only`` validates the gates it stands
on before running anything, rules must name tests that exist, unknown ``--upto``
/ ``--from`` ids are errors, a bad report is a one-line error, ``show | head``
is silent, and a rank that fails under torchrun is reported in seconds instead
of leaving the other ranks waiting in a collective.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gate_trees import alive, gate, running_in, write_phase
from gates.cli import main

REPO = Path(__file__).resolve().parents[1]
OK = {"test_ok.py": "def test_ok():\n    pass\n"}


def test_list_exits_nonzero_on_a_broken_gate_file(tmp_path, capsys):
    write_phase(tmp_path, "01", gate("01"), OK)
    assert main(["--root", str(tmp_path), "list"]) == 0
    bad = gate("02", ["01"])
    bad["runs"] = []
    write_phase(tmp_path, "02", bad, OK)
    assert main(["--root", str(tmp_path), "list"]) == 1
    assert "BROKEN gate.yaml runs: must not be empty" in capsys.readouterr().out


def test_list_exits_nonzero_on_a_cycle_or_an_unknown_dependency(tmp_path, capsys):
    write_phase(tmp_path, "01", gate("01", ["02"]), OK)
    write_phase(tmp_path, "02", gate("02", ["01"]), OK)
    assert main(["--root", str(tmp_path), "list"]) == 1
    assert "dependency cycle" in capsys.readouterr().out
    write_phase(tmp_path, "02", gate("02", ["07"]), OK)
    assert main(["--root", str(tmp_path), "list"]) == 1
    assert "unknown phase(s) 07" in capsys.readouterr().out


def test_run_only_validates_the_gates_it_stands_on_before_running_anything(tmp_path, capsys):
    """--only 03 reads 03's dependencies transitively: a cycle or a broken gate among them
    is an error (exit 2) and no test runs."""
    marker = tmp_path / "ran"
    runs = {"test_ok.py": f"def test_ok():\n    open({str(marker)!r}, 'w').close()\n"}
    write_phase(tmp_path, "01", gate("01", ["02"]), runs)
    write_phase(tmp_path, "02", gate("02", ["01"]), runs)
    write_phase(tmp_path, "03", gate("03", ["02"]), runs)
    assert main(["--root", str(tmp_path), "run", "--only", "03"]) == 2
    assert "dependency cycle (a -> b: a depends on b): 01 -> 02 -> 01" in capsys.readouterr().err
    broken = gate("01")
    broken["id"] = 1
    write_phase(tmp_path, "01", broken, runs)
    assert main(["--root", str(tmp_path), "run", "--only", "03"]) == 2
    assert "phases/01_p/gate.yaml: id: must be a two-digit string" in capsys.readouterr().err
    write_phase(tmp_path, "01", gate("01", ["05"]), runs)
    assert main(["--root", str(tmp_path), "run", "--only", "03"]) == 2
    assert "phases/01_p/gate.yaml: depends_on: unknown phase 05" in capsys.readouterr().err
    assert not marker.exists()


@pytest.mark.parametrize("flag", ["--upto", "--from"])
def test_unknown_upto_or_from_id_is_an_error(tmp_path, capsys, flag):
    write_phase(tmp_path, "01", gate("01"), OK)
    assert main(["--root", str(tmp_path), "run", flag, "99"]) == 2
    assert f"{flag}: unknown phase id 99" in capsys.readouterr().err


def test_a_rule_naming_a_missing_test_fails_run_and_show(tmp_path, capsys):
    rules = [{"rule": "exists", "test": "phases/01_p/test_ok.py::test_ok"},
             {"rule": "misspelled", "test": "phases/01_p/test_ok.py::test_okay"},
             {"rule": "no such file", "test": "phases/01_p/test_gone.py::test_gone"}]
    write_phase(tmp_path, "01", gate("01", eager_gate=rules), OK)
    assert main(["--root", str(tmp_path), "show", "01"]) == 1
    captured = capsys.readouterr()
    assert "phases/01_p/test_ok.py::test_ok\n" in captured.out
    assert "phases/01_p/test_ok.py::test_okay  [no such test]" in captured.out
    assert "phases/01_p/test_gone.py::test_gone  [test file missing]" in captured.out
    assert "2 eager-gate rule(s) name a test that does not exist" in captured.err
    report = tmp_path / "r.json"
    assert main(["--root", str(tmp_path), "run", "--report", str(report)]) == 1
    phase = json.loads(report.read_text())["phases"][0]
    assert phase["status"] == "FAIL" and phase["runs"] == []
    assert phase["reason"] == ("eager-gate rule names no test: phases/01_p/test_ok.py::test_okay, "
                               "phases/01_p/test_gone.py::test_gone")


def test_rule_test_ids_may_be_parametrized_methods_or_imported(tmp_path, capsys):
    files = {"test_kinds.py": "import pytest\nfrom helpers_x import test_shared  # noqa: F401\n\n\n"
                              "@pytest.mark.parametrize('n', [1, 2])\ndef test_param(n):\n    pass\n\n\n"
                              "class TestGroup:\n    def test_method(self):\n        pass\n",
             "helpers_x.py": "def test_shared():\n    pass\n"}
    rules = [{"rule": r, "test": f"phases/01_p/test_kinds.py::{r}"}
             for r in ("test_param", "test_param[2]", "TestGroup::test_method", "test_shared")]
    write_phase(tmp_path, "01", gate("01", eager_gate=rules), files)
    assert main(["--root", str(tmp_path), "show", "01"]) == 0
    assert "[no such test]" not in capsys.readouterr().out


def test_status_on_a_missing_or_corrupt_report_is_a_one_line_error(tmp_path):
    def status(path):
        return subprocess.run([sys.executable, "-m", "gates", "--root", str(tmp_path), "status", "--report",
                               str(path)], capture_output=True, text=True, cwd=REPO, timeout=120)

    write_phase(tmp_path, "01", gate("01"), OK)
    missing = status(tmp_path / "nope.json")
    (tmp_path / "corrupt.json").write_text('{"phases": [')
    corrupt = status(tmp_path / "corrupt.json")
    (tmp_path / "other.json").write_text('{"phases": [{"id": "01"}]}')
    other = status(tmp_path / "other.json")
    for proc, words in ((missing, "no report at"), (corrupt, "not valid JSON"), (other, "not a gate report")):
        assert proc.returncode == 2 and proc.stdout == ""
        assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: ") and words in proc.stderr


def test_show_piped_into_head_is_silent(tmp_path):
    """The reader closes the pipe after one line while show still has ~200 KB to write."""
    fms = [{"id": f"FM-{i:03d}", "symptom": "s" * 300, "check": "c", "fix": "f", "tests": ["test_ok"]}
           for i in range(600)]
    write_phase(tmp_path, "01", gate("01", failure_modes=fms), OK)
    proc = subprocess.Popen([sys.executable, "-m", "gates", "--root", str(tmp_path), "show", "01"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().startswith("01  phase 01")
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 0
    assert err == ""


RANK1_FAILS_BEFORE_A_COLLECTIVE = """
import pytest
import torch
import torch.distributed as dist


@pytest.mark.torchrun
def test_rank1_fails_while_rank0_waits():
    dist.init_process_group("gloo")
    assert dist.get_rank() != 1, "rank 1 found the planted fault"
    t = torch.ones(1)
    dist.all_reduce(t)  # rank 0 waits here for a rank that will never come


@pytest.mark.torchrun
def test_later_collective():
    dist.barrier()
"""


def test_a_failing_rank_aborts_the_group_instead_of_hanging(tmp_path):
    """Without the abort, rank 0 would wait in all_reduce for gloo's 30-minute default, and the
    run would end by its own timeout (240 s here): it must end on the fault instead."""
    write_phase(tmp_path, "01", gate("01", runs=[{"mode": "torchrun", "nproc": [2], "timeout_s": 240,
                                                 "tests": ["phases/01_p"]}]),
                {"test_tp.py": RANK1_FAILS_BEFORE_A_COLLECTIVE})
    report = tmp_path / "r.json"
    assert main(["--root", str(tmp_path), "run", "--report", str(report)]) == 1
    run = json.loads(report.read_text())["phases"][0]["runs"][0]
    assert "timeout" not in run["reason"], run["reason"]
    failing = {t["nodeid"]: t for t in run["failing"]}
    first = failing["phases/01_p/test_tp.py::test_rank1_fails_while_rank0_waits"]
    # rank 0 may also record a failure (its all_reduce sees the peer go); the cause is reported
    assert 1 in first["ranks"] and "rank 1 found the planted fault" in first["message"]
    # the failing rank left at once: no rank went on to the next test (torchrun's own error
    # summary may push the plugin's "aborting this rank" line out of the output tail)
    assert [t["nodeid"] for t in run["test_results"]] == ["phases/01_p/test_tp.py::test_rank1_fails_while_rank0_waits"]


HANGS_IN_A_COLLECTIVE = """
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist


@pytest.mark.torchrun
def test_rank1_never_joins():
    dist.init_process_group("gloo")
    (Path(__file__).parent / f"pid{dist.get_rank()}").write_text(str(os.getpid()))
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(1))  # rank 1 never joins
    else:
        dist.barrier()
"""


def test_a_torchrun_timeout_kills_every_rank(tmp_path, monkeypatch):
    """torchrun starts each rank in a session of its own: the timeout must still kill them
    all (and the run must end), not only torchrun's process group. Ranks the kill missed would
    keep the output pipe open until gloo's 30-minute default ends them, so a run still going
    600 s in is one that waited for them (a bound far from both, not a speed limit); the ranks
    write their pids once they have joined, which on a loaded machine may come after the 25 s,
    so those are checked when written and the tree's processes are scanned in every case."""
    monkeypatch.setenv("GATES_ABORT_ON_FAILURE", "0")
    write_phase(tmp_path, "01", gate("01", runs=[{"mode": "torchrun", "nproc": [2], "timeout_s": 25,
                                                 "tests": ["phases/01_p"]}]),
                {"test_hang.py": HANGS_IN_A_COLLECTIVE})
    report = tmp_path / "r.json"
    start = time.monotonic()
    assert main(["--root", str(tmp_path), "run", "--report", str(report)]) == 1
    assert time.monotonic() - start < 600, "the run waited for ranks the timeout should have killed"
    assert "timeout after 25 s" in json.loads(report.read_text())["phases"][0]["reason"]
    assert running_in(tmp_path) == []
    for rank in (0, 1):
        pid_file = tmp_path / "phases/01_p" / f"pid{rank}"
        if pid_file.exists():
            pid = int(pid_file.read_text())
            assert not alive(pid), f"rank {rank} (pid {pid}) outlived the timeout"
