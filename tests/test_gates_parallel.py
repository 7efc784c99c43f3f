"""The runner's CPU slots (``python -m gates run --jobs N``) and its flake detector
(``--repeat N --load``), on temporary phase trees: independent phases really run side by side,
a phase still waits for what it stands on, output stays in dependency order, a single run
spreads its files over free slots (a pytest session each, forked from the pre-importing server,
running its own tree's code), and a test whose outcome changes between repeats is named.
Concurrency is shown by behaviour (each test waits for the other's file), never by timing."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from gate_trees import gate, write_phase
from gates import flaky
from gates.runner import OrderedOutput
from test_gates_run import by_id, passing_test, run_cli

# Writes its own marker, then polls (60 s hang guard) for the other phase's: passes only when the
# two phases' runs are alive at the same time.
MEET = """
import time
from pathlib import Path

ROOT = Path(__file__).parents[2]


def test_meets_the_other_phase():
    (ROOT / "{me}.started").write_text("")
    deadline = time.monotonic() + 60
    while not (ROOT / "{other}.started").exists():
        assert time.monotonic() < deadline, "the other phase never ran beside this one"
        time.sleep(0.05)
"""

# Fails on the first run of the tree, passes on later ones (a counter file beside the tree).
FLIPS = """
from pathlib import Path

COUNT = Path(__file__).parents[2] / "runs.count"


def test_flips():
    runs = int(COUNT.read_text()) if COUNT.exists() else 0
    COUNT.write_text(str(runs + 1))
    assert runs > 0, "first run"


def test_steady():
    pass
"""


def test_independent_phases_run_side_by_side_after_what_they_stand_on(tmp_path):
    """02 and 03 both stand on 01 only: with two slots they run at once (each test waits for the
    other's file); 01 runs first and alone."""
    write_phase(tmp_path, "01", gate("01"), passing_test("01"))
    write_phase(tmp_path, "02", gate("02", ["01"]), {"test_meet.py": MEET.format(me="02", other="03")})
    write_phase(tmp_path, "03", gate("03", ["01"]), {"test_meet.py": MEET.format(me="03", other="02")})
    code, out, report = run_cli(tmp_path, "--jobs", "2")
    assert code == 0, out
    assert [(p["id"], p["status"]) for p in report["phases"]] == [("01", "PASS"), ("02", "PASS"), ("03", "PASS")]
    assert (tmp_path / "order.log").read_text().split() == ["01"]
    # printed in dependency order, each phase's block whole
    assert out.index("== 01") < out.index("01: PASS") < out.index("== 02") < out.index("02: PASS") \
        < out.index("== 03") < out.index("03: PASS")


def test_a_phase_blocked_by_a_failure_never_runs_beside_others(tmp_path):
    """With slots to spare, a phase whose dependency fails is still BLOCKED and never started."""
    write_phase(tmp_path, "01", gate("01"), {"test_fail.py": "def test_fails():\n    assert False\n"})
    write_phase(tmp_path, "02", gate("02", ["01"]), passing_test("02"))
    write_phase(tmp_path, "03", gate("03"), passing_test("03"))
    code, _, report = run_cli(tmp_path, "--jobs", "4")
    phases = by_id(report)
    assert code == 1 and phases["02"]["status"] == "BLOCKED" and phases["02"]["runs"] == []
    assert phases["03"]["status"] == "PASS"
    assert (tmp_path / "order.log").read_text().split() == ["03"]


# Records the process it ran in, marks that its file started, then polls (30 s hang guard) until
# another file of the phase has started too: the first file passes only when a second one ran
# beside it.
WHERE = """
import os
import time
from pathlib import Path

HERE = Path(__file__).parent


def test_where():
    (HERE / (Path(__file__).stem + ".pid")).write_text(str(os.getpid()))
    (HERE / (Path(__file__).stem + ".started")).write_text("")
    deadline = time.monotonic() + 30
    while len(list(HERE.glob("*.started"))) < 2:
        assert time.monotonic() < deadline, "no other file of the phase ran beside this one"
        time.sleep(0.05)
"""

# Fails when another file of the phase is running at the same time.
ALONE = """
import os
import time
from pathlib import Path

HERE = Path(__file__).parent


def test_alone():
    mine = HERE / (Path(__file__).stem + ".running")
    mine.write_text("")
    others = [p.name for p in HERE.glob("*.running") if p != mine]
    time.sleep(0.3)
    mine.unlink()
    assert not others, others
"""


def test_a_single_run_spreads_its_files_over_free_slots(tmp_path):
    """One phase, six test files, two slots: every file ran in a pytest session of its own (six
    processes, none of them the runner), two at a time (the first file waits for a second to
    start), and the report holds every test under the one run the gate declares."""
    write_phase(tmp_path, "01", gate("01"), {f"test_where_{i}.py": WHERE for i in range(6)})
    code, out, report = run_cli(tmp_path, "--jobs", "2")
    (run,) = by_id(report)["01"]["runs"]
    assert code == 0, out
    assert run["files"] == 6 and run["status"] == "passed" and "(6 files)" in out
    assert sorted(t["nodeid"] for t in run["test_results"]) == [
        f"phases/01_p/test_where_{i}.py::test_where" for i in range(6)]
    pids = {(tmp_path / "phases/01_p" / f"test_where_{i}.pid").read_text() for i in range(6)}
    assert len(pids) == 6 and str(os.getpid()) not in pids
    assert " -n " not in run["command"] and run["command"].endswith("-m 'not torchrun' phases/01_p")


def test_one_job_runs_one_thing_at_a_time(tmp_path):
    write_phase(tmp_path, "01", gate("01"), {f"test_alone_{i}.py": ALONE for i in range(3)})
    code, out, report = run_cli(tmp_path, "--jobs", "1")
    (run,) = by_id(report)["01"]["runs"]
    assert code == 0 and run["files"] == 3 and run["counts"]["passed"] == 3, out


# Marks itself running and fails if the benchmark is running; stays until 0.5 s after the
# benchmark has started (2 s hang guard), so a benchmark started beside it sees its mark.
BUSY = """
import time
from pathlib import Path

ROOT = Path(__file__).parents[2]


def test_busy():
    mine = ROOT / (Path(__file__).parent.name + Path(__file__).stem + ".running")
    mine.write_text("")
    assert not (ROOT / "bench.active").exists(), "started beside the benchmark"
    deadline = time.monotonic() + 2
    while not (ROOT / "bench.started").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)
    mine.unlink()
"""

# Fails when any other file of the gate run runs during its first second.
BENCH = """
import time
from pathlib import Path

ROOT = Path(__file__).parents[2]


def test_bench():
    (ROOT / "bench.active").write_text("")
    (ROOT / "bench.started").write_text("")
    deadline = time.monotonic() + 1
    while time.monotonic() < deadline:
        assert not sorted(p.name for p in ROOT.glob("*.running"))
        time.sleep(0.05)
    (ROOT / "bench.active").unlink()
"""


def test_a_run_marked_alone_has_nothing_beside_it(tmp_path):
    """Four slots, a phase with two busy files and a benchmark run marked alone, another phase with
    a busy file: each busy file lives until 0.5 s after the benchmark started (2 s at most), so
    without ``alone`` the benchmark starts beside them and sees them; with it, it starts once they
    have ended, and a busy file that would start while it runs fails."""
    runs = [{"mode": "single", "tests": ["phases/01_p/test_busy_a.py", "phases/01_p/test_busy_b.py"]},
            {"mode": "single", "tests": ["phases/01_p/test_bench.py"], "alone": True}]
    write_phase(tmp_path, "01", gate("01", runs=runs), {"test_busy_a.py": BUSY, "test_busy_b.py": BUSY,
                                                        "test_bench.py": BENCH})
    write_phase(tmp_path, "02", gate("02"), {"test_busy_c.py": BUSY})
    code, out, report = run_cli(tmp_path, "--jobs", "4")
    assert code == 0, out
    assert [(p["id"], p["status"]) for p in report["phases"]] == [("01", "PASS"), ("02", "PASS")]


def test_a_file_whose_session_dies_fails_the_run_naming_it(tmp_path):
    """A test file that ends its process (a crash) writes no results: its file is reported as an
    error with the exit code, the run fails, and the other files' tests still count."""
    write_phase(tmp_path, "01", gate("01"), {"test_dies.py": "import os\n\n\ndef test_dies():\n    os._exit(3)\n",
                                             "test_fine.py": "def test_fine():\n    pass\n"})
    code, out, report = run_cli(tmp_path, "--jobs", "2")
    (run,) = by_id(report)["01"]["runs"]
    assert code == 1 and run["status"] == "failed" and run["counts"]["passed"] == 1
    (failing,) = run["failing"]
    assert failing["nodeid"] == "phases/01_p/test_dies.py" and failing["outcome"] == "error"
    assert "exit code 3" in failing["message"]


# Reports the tree its package was imported from.
WHICH_TREE = """
from pathlib import Path

import treepkg


def test_imports_its_own_tree():
    assert Path(treepkg.__file__).resolve().is_relative_to(Path(__file__).resolve().parents[2])
    assert treepkg.TREE == {tree!r}
"""


def test_each_tree_runs_its_own_code(tmp_path):
    """Two trees with a package of the same name run one after another in one runner process (as
    ``gates audit`` runs mutated copies): each session imports the package of its own tree, never
    one the fork server or an earlier session imported."""
    for name in ("a", "b"):
        tree = tmp_path / name
        write_phase(tree, "01", gate("01"), {"test_which.py": WHICH_TREE.format(tree=name)})
        (tree / "treepkg").mkdir()
        (tree / "treepkg" / "__init__.py").write_text(f"TREE = {name!r}\n")
        code, out, report = run_cli(tree)
        assert code == 0 and by_id(report)["01"]["status"] == "PASS", out


def test_sessions_get_the_trees_cpu_variables(tmp_path):
    """``[tool.gates] cpu-env`` in the tree's pyproject.toml reaches every session on a machine
    without CUDA (and none with it)."""
    import torch

    want = "" if torch.cuda.is_available() else "on"
    write_phase(tmp_path, "01", gate("01"), {"test_env.py": (
        f"import os\n\n\ndef test_env():\n    assert os.environ.get('GATES_PROBE', '') == {want!r}\n")})
    (tmp_path / "pyproject.toml").write_text('[tool.gates]\ncpu-env = {GATES_PROBE = "on"}\n')
    code, out, report = run_cli(tmp_path)
    assert code == 0, out


def test_ordered_output_holds_a_later_phase_until_the_earlier_ones_finish(capsys):
    out = OrderedOutput(["01", "02", "03"])
    out.say("01", "01 starts")
    out.say("03", "03 starts")
    out.say("02", "02 starts")
    out.finish("03")
    assert capsys.readouterr().out.splitlines() == ["01 starts"]
    out.finish("01")
    assert capsys.readouterr().out.splitlines() == ["02 starts"]
    out.say("02", "02 more")
    out.finish("02")
    assert capsys.readouterr().out.splitlines() == ["02 more", "03 starts"]


def test_repeat_names_a_test_whose_outcome_changed(tmp_path):
    write_phase(tmp_path, "01", gate("01"), {"test_flips.py": FLIPS})
    code, out, report = run_cli(tmp_path, "--repeat", "3")
    assert code == 1
    assert report["repeats"]["differing_tests"] == {
        "01 | single | phases/01_p/test_flips.py::test_flips": ["failed", "passed", "passed"]}
    assert report["repeats"]["statuses"] == [{"01": "FAIL"}, {"01": "PASS"}, {"01": "PASS"}]
    assert "FLAKY 01 | single | phases/01_p/test_flips.py::test_flips: failed, passed, passed" in out
    assert "2 test outcomes compared, 1 differed" in out


def test_repeat_of_a_steady_tree_under_load_finds_nothing(tmp_path):
    write_phase(tmp_path, "01", gate("01"), passing_test("01"))
    code, out, report = run_cli(tmp_path, "--repeat", "2", "--load")
    assert code == 0, out
    assert report["repeats"]["differing_tests"] == {} and report["repeats"]["busy_processes"] >= 1
    assert "beside" in out and "0 differed" in out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] if os.path.exists(f"/proc/{pid}") else "X"
    return state != "Z"


def _wait_until(condition, what: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_busy_processes_end_with_the_block_and_with_their_parent():
    def children() -> set[int]:
        return {int(p) for p in os.listdir("/proc") if p.isdigit() and _child_of(int(p), os.getpid())}

    before = children()   # what earlier tests left running here (a gate run's fork server)
    with flaky.cpu_load(2):
        busy = children() - before
        assert len(busy) == 2 and all(map(_alive, busy))
    assert not any(map(_alive, busy))
    # a runner killed inside the block: its busy process notices and ends by itself
    parent = subprocess.Popen([sys.executable, "-c", "import time\nfrom gates import flaky\n"
                               "with flaky.cpu_load(1):\n    print('up', flush=True)\n    time.sleep(600)"],
                              stdout=subprocess.PIPE, text=True)
    assert parent.stdout.readline().strip() == "up"
    (child,) = [int(p) for p in os.listdir("/proc") if p.isdigit() and _child_of(int(p), parent.pid)]
    parent.kill()
    parent.wait()
    _wait_until(lambda: not _alive(child), "a busy process outlived its parent")


def _child_of(pid: int, parent: int) -> bool:
    try:
        return int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1]) == parent
    except (OSError, IndexError, ValueError):
        return False
