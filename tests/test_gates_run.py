"""End-to-end behaviour of ``python -m gates`` on temporary phase trees.

One module-scoped tree is run three times (full run, a --keep-going/--skip-empty
selection, a passing selection); the tests read the console output, the JSON
report and files the fake tests wrote, so every phase run is a real subprocess.
"""
from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
import torch

from gate_trees import alive, gate, running_in, write_phase
from gates.cli import main
from gates.execute import merge_ranks

LOG_ORDER = """\
from pathlib import Path


def log(name):
    with open(Path(__file__).parents[2] / "order.log", "a") as f:
        f.write(name + "\\n")
"""


def passing_test(name: str) -> dict[str, str]:
    return {"test_ok.py": LOG_ORDER + f"\n\ndef test_ok():\n    log({name!r})\n"}


TORCHRUN_ALL_REDUCE = LOG_ORDER + """
import pytest
import torch
import torch.distributed as dist


@pytest.mark.torchrun
def test_gloo_all_reduce_in_every_rank():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    dist.destroy_process_group()
    log(f"07-rank{rank}")
    assert world == 2 and t.item() == world * (world + 1) / 2
"""

BETA = """
def test_beta_passes():
    pass


def test_beta_fails():
    assert 1 == 2, "beta is broken"
"""

SLEEPS = """
import os
import time
from pathlib import Path


def test_sleeps_past_the_timeout():
    (Path(__file__).parent / "pid").write_text(str(os.getpid()))
    time.sleep(600)
"""


KILLS_ITS_FORKSERVER = """
import os
import signal


def test_kills_the_server_it_was_forked_from():
    os.kill(os.getppid(), signal.SIGKILL)
"""


def fm(fid: str, test: str) -> dict:
    return {"id": fid, "symptom": f"symptom of {fid}", "check": f"check of {fid}",
            "fix": f"fix of {fid}", "tests": [test]}


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    """01 depends on 04 (so dependency order differs from id order); 02 fails;
    03 depends on 02; 05 has no tests; 06 needs cuda; 07 is a torchrun all-reduce;
    08 times out."""
    root = tmp_path_factory.mktemp("tree")
    write_phase(root, "01", gate("01", ["04"]), passing_test("01"))
    write_phase(root, "02", gate("02", ["01"], failure_modes=[fm("FM-900", "test_beta_fails"),
                                                             fm("FM-901", "test_never_written")]),
                {"test_beta.py": BETA})
    write_phase(root, "03", gate("03", ["02"]), passing_test("03"))
    write_phase(root, "04", gate("04", eager_gate=[
        {"rule": "exists", "test": "phases/04_p/test_ok.py::test_ok"}]), passing_test("04"))
    write_phase(root, "05", gate("05"))
    write_phase(root, "06", gate("06", runs=[{"mode": "single", "requires": ["cuda"],
                                              "tests": ["phases/06_p"]}]), passing_test("06"))
    write_phase(root, "07", gate("07", ["04"], runs=[{"mode": "torchrun", "nproc": [2],
                                                     "tests": ["phases/07_p"]}]),
                {"test_tp.py": TORCHRUN_ALL_REDUCE})
    write_phase(root, "08", gate("08", runs=[{"mode": "single", "timeout_s": 6, "tests": ["phases/08_p"]}]),
                {"test_slow.py": SLEEPS})
    return root


@pytest.fixture(scope="module")
def full(tree):
    """The full run of the tree, without --keep-going."""
    return run_cli(tree)


def run_cli(tree, *args):
    """``python -m gates --root tree run ...`` in-process; returns (exit code, stdout, report)."""
    buf = io.StringIO()
    report = tree / f"report-{'_'.join(args) or 'all'}.json"
    with contextlib.redirect_stdout(buf):
        code = main(["--root", str(tree), "run", "--report", str(report), *args])
    return code, buf.getvalue(), json.loads(report.read_text())


def by_id(report):
    return {p["id"]: p for p in report["phases"]}


def test_phases_run_in_dependency_order(full, tree):
    """The report lists phases in dependency order; 04 runs before 01 and 07, which stand on it
    (01 and 07 may then run side by side, in either order)."""
    _, _, report = full
    assert [p["id"] for p in report["phases"]] == ["04", "01", "02", "03", "05", "06", "07", "08"]
    executed = (tree / "order.log").read_text().split()
    assert executed[0] == "04" and sorted(executed[1:]) == ["01", "07-rank0", "07-rank1"]


def test_failure_blocks_dependents_but_independent_phases_run(full, tree):
    _, _, report = full
    phases = by_id(report)
    assert phases["02"]["status"] == "FAIL"
    assert phases["03"]["status"] == "BLOCKED" and "02 FAIL" in phases["03"]["reason"]
    assert phases["03"]["runs"] == [] and "03" not in (tree / "order.log").read_text().split()
    assert phases["04"]["status"] == "PASS" and phases["07"]["status"] == "PASS"


def test_phase_without_tests_fails(full):
    phase = by_id(full[2])["05"]
    assert phase["status"] == "FAIL" and "no tests" in phase["reason"]


def test_missing_requirement_skips_with_the_reason(full):
    phase = by_id(full[2])["06"]
    if torch.cuda.is_available():
        assert phase["status"] == "PASS"
    else:
        assert phase["status"] == "SKIP" and "requires cuda" in phase["reason"]
        assert phase["runs"][0]["status"] == "skipped" and phase["runs"][0]["command"] == ""


def test_a_cuda_torchrun_run_needs_a_gpu_per_rank(monkeypatch):
    """On a one-GPU host a `requires: [cuda]` torchrun run at 2 ranks is skipped with the reason
    (not run to a test-level skip, which would leave the phase with a run that ran no test)."""
    from gates.execute import missing_requirements
    from gates.schema import Run

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    run = Run("torchrun", ("phases/11_p",), nproc=(2,), requires=("cuda",))
    assert missing_requirements(run, 2) == ["cuda on 2 GPUs, one per rank (1 here)"]
    assert missing_requirements(run, 1) == []
    assert missing_requirements(Run("single", ("phases/11_p",), requires=("cuda",))) == []


def test_torchrun_runs_a_gloo_all_reduce_in_every_rank(full):
    run = by_id(full[2])["07"]["runs"][0]
    assert run["mode"] == "torchrun" and run["nproc"] == 2 and run["status"] == "passed"
    assert "--standalone --nproc_per_node 2" in run["command"] and "--master_port" not in run["command"]
    assert [(r["rank"], r["counts"]["passed"]) for r in run["ranks"]] == [(0, 1), (1, 1)]


def test_nproc_option_keeps_only_those_torchrun_sizes(tmp_path):
    """--nproc 2: a gate naming [2, 3] runs at 2 ranks only (its test asserts a world of 2, so
    the 3-rank run would fail); a phase with no run at that size is SKIP."""
    write_phase(tmp_path, "01", gate("01", runs=[{"mode": "torchrun", "nproc": [2, 3], "tests": ["phases/01_p"]}]),
                {"test_tp.py": TORCHRUN_ALL_REDUCE})
    write_phase(tmp_path, "02", gate("02", runs=[{"mode": "torchrun", "nproc": [4], "tests": ["phases/02_p"]}]),
                {"test_tp.py": TORCHRUN_ALL_REDUCE})
    code, _, report = run_cli(tmp_path, "--nproc", "2")
    phases = by_id(report)
    assert [(r["nproc"], r["status"]) for r in phases["01"]["runs"]] == [(2, "passed")]
    assert phases["01"]["status"] == "PASS" and code == 0
    assert "nproc=3 not run (--nproc)" in phases["01"]["reason"]
    assert phases["02"]["status"] == "SKIP" and phases["02"]["runs"] == []


def test_a_test_failing_in_any_rank_fails_the_merged_result():
    def rank(r, outcome):
        return {"rank": r, "exitstatus": 0, "tests": [
            {"nodeid": "t.py::a", "outcome": "passed", "duration_s": 0.1, "message": ""},
            {"nodeid": "t.py::b", "outcome": outcome, "duration_s": 0.2, "message": f"rank {r}"}]}

    merged, ranks = merge_ranks([rank(1, "failed"), rank(0, "passed")])
    assert merged["t.py::a"]["outcome"] == "passed"
    assert merged["t.py::b"]["outcome"] == "failed" and merged["t.py::b"]["ranks"] == [1]
    assert merged["t.py::b"]["message"] == "rank 1"
    assert [(r["rank"], r["counts"]["failed"]) for r in ranks] == [(0, 0), (1, 1)]


def test_merged_message_is_the_first_failing_ranks():
    """Both ranks fail a test: the message kept is the one of the rank that failed first by the
    wall clock (the cause), not the lost-peer error its partner hit afterwards, even when the
    partner's test took less time (it joined the rendezvous later)."""
    def rank(r, failed_at, message):
        return {"rank": r, "exitstatus": 1, "tests": [{"nodeid": "t.py::a", "outcome": "failed",
                                                        "duration_s": 0.1, "message": message, "failed_at": failed_at}]}

    merged, _ = merge_ranks([rank(0, 1000.2, "Connection closed by peer"), rank(1, 1000.1, "the planted fault")])
    assert merged["t.py::a"]["ranks"] == [0, 1] and merged["t.py::a"]["message"] == "the planted fault"


def test_timeout_kills_the_run_and_fails_the_phase(full, tree):
    """The run past its timeout is killed: nothing it started is left running. (The sleeping test
    writes its pid when it starts, which on a loaded machine may come after the 6 s, so that pid
    is checked only when written; the scan of the tree's processes covers both cases.)"""
    phase = by_id(full[2])["08"]
    assert phase["status"] == "FAIL" and "timeout after 6 s" in phase["reason"]
    assert running_in(tree) == []
    pid_file = tree / "phases/08_p/pid"
    if pid_file.exists():
        assert not alive(int(pid_file.read_text()))


def test_failing_tests_and_matching_failure_modes_are_printed(full):
    _, out, report = full
    assert "FAILED phases/02_p/test_beta.py::test_beta_fails" in out
    assert "beta is broken" in out
    assert "FM-900" in out and "symptom of FM-900" in out and "check of FM-900" in out and "fix of FM-900" in out
    assert "FM-901" not in out
    assert by_id(report)["02"]["failure_modes"] == ["FM-900"]
    assert by_id(report)["02"]["failing_tests"] == ["phases/02_p/test_beta.py::test_beta_fails"]


def test_summary_table_lists_every_phase(full):
    table = full[1].split("\nphase ")[-1].splitlines()[1:]
    assert [line.split()[:2] for line in table[:8]] == [
        ["04", "PASS"], ["01", "PASS"], ["02", "FAIL"], ["03", "BLOCKED"], ["05", "FAIL"],
        ["06", "PASS" if torch.cuda.is_available() else "SKIP"], ["07", "PASS"], ["08", "FAIL"]]


def test_json_report_has_the_documented_fields(full):
    code, _, report = full
    assert report["exit_code"] == code == 1
    assert set(report["machine"]) >= {"python", "torch", "device", "gpu", "hostname", "timestamp"}
    assert report["machine"]["torch"] == torch.__version__
    beta = by_id(report)["02"]
    assert set(beta) >= {"id", "status", "reason", "runs", "counts", "duration_s", "failing_tests"}
    assert beta["counts"] == {"passed": 1, "failed": 1, "skipped": 0, "errors": 0}
    run = beta["runs"][0]
    assert set(run) >= {"mode", "nproc", "command", "returncode", "counts", "duration_s", "failing"}
    assert run["returncode"] == 1 and run["duration_s"] > 0 and "-m 'not torchrun'" in run["command"]


def test_keep_going_and_skip_empty(tree):
    code, out, report = run_cli(tree, "--only", "02,03,05", "--keep-going", "--skip-empty")
    phases = by_id(report)
    assert code == 1 and list(phases) == ["02", "03", "05"]
    assert phases["02"]["status"] == "FAIL"
    assert phases["03"]["status"] == "PASS" and "ran although dependency 02 FAIL" in phases["03"]["reason"]
    assert phases["05"]["status"] == "SKIP" and "no test files yet" in phases["05"]["reason"]
    assert "02 depends on 01, outside the selection: not enforced" in out


def test_exit_code_zero_when_everything_passes_or_skips(tree):
    code, _, report = run_cli(tree, "--only", "04,05,06,07", "--mode", "single", "--skip-empty")
    statuses = {p["id"]: p["status"] for p in report["phases"]}
    assert code == 0
    assert statuses["04"] == "PASS" and statuses["05"] == "SKIP"
    assert statuses["07"] == "SKIP" and by_id(report)["07"]["reason"] == "no single runs"


def test_list_and_show(tree, capsys):
    assert main(["--root", str(tree), "list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines][:2] == ["04", "01"]
    assert "no tests yet" in next(line for line in lines if line.startswith("05"))
    assert main(["--root", str(tree), "show", "04"]) == 0
    assert "phases/04_p/test_ok.py::test_ok\n" in capsys.readouterr().out


def test_bad_trees_are_clear_errors_with_exit_code_2(tmp_path, capsys):
    write_phase(tmp_path, "01", gate("01", ["02"]), passing_test("01"))
    write_phase(tmp_path, "02", gate("02", ["01"]), passing_test("02"))
    assert main(["--root", str(tmp_path), "run"]) == 2
    assert "dependency cycle (a -> b: a depends on b): 01 -> 02 -> 01" in capsys.readouterr().err
    write_phase(tmp_path, "02", gate("02", ["42"]))
    assert main(["--root", str(tmp_path), "run"]) == 2
    assert "phases/02_p/gate.yaml: depends_on: unknown phase 42" in capsys.readouterr().err
    write_phase(tmp_path, "03", None)
    assert main(["--root", str(tmp_path), "run", "--only", "03"]) == 2
    assert "phases/03_p/gate.yaml: missing" in capsys.readouterr().err
    assert main(["--root", str(tmp_path), "list"]) == 1
    assert "BROKEN gate.yaml missing" in capsys.readouterr().out
    assert not (tmp_path / "order.log").exists()


def test_status_prints_the_table_of_a_report(full, tree, capsys):
    assert main(["--root", str(tree), "status", "--report", str(tree / "report-all.json")]) == 0
    rows = capsys.readouterr().out.strip().splitlines()[1:]
    assert [row.split()[:2] for row in rows] == [[p["id"], p["status"]] for p in full[2]["phases"]]


def test_misspelled_test_id_or_collection_error_fails_even_with_skip_empty(tmp_path):
    """pytest exits 4 (no such test id) or 2 (a test file does not import): FAIL, never the
    'no tests yet' SKIP of --skip-empty."""
    write_phase(tmp_path, "01", gate("01", runs=[{"mode": "single", "tests": ["phases/01_p/test_ok.py::test_typo"]}]),
                {"test_ok.py": "def test_ok():\n    pass\n"})
    write_phase(tmp_path, "02", gate("02"), {"test_broken.py": "import no_such_module_here\n"})
    code, _, report = run_cli(tmp_path, "--keep-going", "--skip-empty")
    phases = by_id(report)
    assert code == 1
    assert phases["01"]["status"] == "FAIL" and "exit code 4" in phases["01"]["reason"] + str(phases["01"]["runs"])
    assert phases["02"]["status"] == "FAIL"


def test_a_session_whose_forkserver_dies_keeps_the_exit_status_it_recorded(tmp_path, capfd):
    """The server that forks the sessions dies while one runs (multiprocessing then reports 255 for
    it, as a clean clone's ``make gates`` once did for a phase whose every test passed): the run
    takes the exit status the session recorded with its results, passes, and says so on stderr; the
    next phase's session is forked by a new server."""
    write_phase(tmp_path, "01", gate("01"), {"test_kill.py": KILLS_ITS_FORKSERVER})
    write_phase(tmp_path, "02", gate("02", ["01"]), passing_test("02"))
    code, out, report = run_cli(tmp_path)
    phases = by_id(report)
    assert code == 0 and phases["01"]["status"] == "PASS" and phases["02"]["status"] == "PASS", out
    assert "was lost (multiprocessing reported 255" in capfd.readouterr().err


def test_a_start_refused_by_a_dying_server_is_tried_again(tmp_path, monkeypatch):
    """A server that has just died closes its socket before it exits, and multiprocessing starts a
    new one only once it has exited: the first connection is refused (a clean clone's CI met this
    right after the test above). The start is tried again and the session runs."""
    from multiprocessing import forkserver

    connect, refused = forkserver.connect_to_new_process, []

    def refuse_once(fds):
        if not refused:
            refused.append(True)
            raise ConnectionRefusedError(111, "Connection refused")
        return connect(fds)

    monkeypatch.setattr(forkserver, "connect_to_new_process", refuse_once)
    write_phase(tmp_path, "01", gate("01"), passing_test("01"))
    code, out, report = run_cli(tmp_path)
    assert code == 0 and by_id(report)["01"]["status"] == "PASS" and refused == [True], out


def test_a_session_killed_while_writing_its_results_leaves_no_half_written_file(tmp_path, monkeypatch):
    """The runner stops the other sessions of a run once one fails; one stopped while writing its
    results must leave no file the runner cannot read (an audit's gate run died on an empty
    rank0.json: "JSONDecodeError: Expecting value")."""
    from gates import pytest_plugin

    monkeypatch.setenv("GATES_RESULT_DIR", str(tmp_path))
    monkeypatch.setattr(pytest_plugin, "_xdist_worker", False)  # this test may itself run in an xdist worker
    monkeypatch.setattr(pytest_plugin, "_tests", {"t": {"nodeid": "t", "outcome": "passed"}})
    real_write_text = Path.write_text

    def killed_half_way(self, text, *args, **kwargs):
        real_write_text(self, text[: len(text) // 2], *args, **kwargs)
        raise KeyboardInterrupt("killed while writing")

    monkeypatch.setattr(Path, "write_text", killed_half_way)
    with pytest.raises(KeyboardInterrupt):
        pytest_plugin._write(exitstatus=0)
    monkeypatch.setattr(Path, "write_text", real_write_text)
    assert not (tmp_path / "rank0.json").exists()
    pytest_plugin._write(exitstatus=0)
    assert json.loads((tmp_path / "rank0.json").read_text())["tests"] == [{"nodeid": "t", "outcome": "passed"}]
