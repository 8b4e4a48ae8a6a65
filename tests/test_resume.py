"""slimgc_mx.resume.JobCheckpoints: atomic per-rank parts, completeness, pruning, restore.

The trainer and net are stand-ins that write their state as text, so these tests need
no MXNet; the multi-process guarantee (kill -9 any node, same weights) is
tests/test_faults.py.
"""
import os

import pytest

from slimgc_mx.resume import JobCheckpoints


class Stub:
    """Trainer and net in one: save/load a value as text, the way the real ones do files."""

    def __init__(self, value=None):
        self.value = value

    def save_states(self, path):
        with open(path, "w") as f:
            f.write("states %s" % self.value)

    def load_states(self, path):
        with open(path) as f:
            self.states = f.read()

    def save_parameters(self, path):
        with open(path, "w") as f:
            f.write("params %s" % self.value)

    def load_parameters(self, path):
        with open(path) as f:
            self.params = f.read()


def save_all(directory, step, workers=2, value=None):
    for rank in range(workers):
        stub = Stub(value if value is not None else step)
        JobCheckpoints(directory, rank, workers).save(step, stub, stub, {"at": step})


def test_a_fresh_directory_has_nothing_to_restore(tmp_path):
    stub = Stub()
    assert JobCheckpoints(str(tmp_path / "ck"), 0, 2).restore(stub, stub) is None
    assert not hasattr(stub, "params")


def test_the_newest_complete_checkpoint_is_restored(tmp_path):
    d = str(tmp_path)
    save_all(d, 10)
    save_all(d, 20)
    stub = Stub()
    pos = JobCheckpoints(d, 1, 2).restore(stub, stub)
    assert pos["at"] == 20 and pos["step"] == 20
    assert pos["path"] == os.path.join(d, "step-00000020")
    assert stub.params == "params 20" and stub.states == "states 20"


def test_a_checkpoint_missing_a_ranks_part_is_never_loaded(tmp_path):
    d = str(tmp_path)
    save_all(d, 10)
    JobCheckpoints(d, 0, 2).save(20, Stub(20), Stub(20), {"at": 20})  # rank 1 died first
    os.makedirs(os.path.join(d, "step-00000030"))  # and a torn directory
    open(os.path.join(d, "step-00000030", "rank1.states.tmp"), "w").close()
    assert JobCheckpoints(d, 0, 2).complete() == [10]
    stub = Stub()
    assert JobCheckpoints(d, 1, 2).restore(stub, stub)["at"] == 10
    assert stub.params == "params 10"


def test_a_rewritten_part_is_incomplete_until_its_marker(tmp_path):
    d = str(tmp_path)
    save_all(d, 10)
    ck = JobCheckpoints(d, 0, 2)

    class Crashes(Stub):
        def save_parameters(self, path):
            raise OSError("disk full")

    with pytest.raises(OSError):  # an earlier attempt's marker for step 10 is gone first
        ck.save(10, Stub(10), Crashes(10), {"at": 10})
    assert ck.complete() == []


def test_only_the_last_two_complete_checkpoints_stay(tmp_path):
    d = str(tmp_path)
    for step in (10, 20, 30, 40):
        save_all(d, step)
    assert sorted(os.listdir(d)) == ["step-00000030", "step-00000040"]
    assert JobCheckpoints(d, 0, 2).complete() == [30, 40]


def test_another_worker_count_is_refused(tmp_path):
    d = str(tmp_path)
    save_all(d, 10, workers=1)
    open(os.path.join(d, "step-00000010", "rank1.done"), "w").close()  # complete for 2
    stub = Stub()
    with pytest.raises(ValueError, match="written by a job of 1 worker; this job has 2"):
        JobCheckpoints(d, 0, 2).restore(stub, stub)
    assert not hasattr(stub, "params")  # nothing half-loaded


def test_keep_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match="keep"):
        JobCheckpoints(str(tmp_path), 0, 1, keep=0)
