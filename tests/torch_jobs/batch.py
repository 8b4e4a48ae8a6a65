"""A rank of several jobs of this folder, one after the other in one process group: what
would otherwise be one torchrun per job (torch_launch.Batch). argv[2]: a JSON list of
[script, out, args...]; each script runs as torchrun would run it (its sys.argv, as
__main__), its init_process_group() and destroy_process_group() calls doing nothing here,
since the group is made once. After a job every rank meets the others and writes
OUT/.done_RANK. A job that raises ends the batch, its traceback in OUT/.failed_RANK, with a
non-zero status (torchrun then stops the other ranks): the jobs after it do not run."""
import faulthandler
import json
import os
import runpy
import signal
import sys
import time
import traceback

import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
jobs = json.loads(sys.argv[2])
faulthandler.register(signal.SIGUSR1, all_threads=True)  # stacks for torch_launch's timeout
dist.init_process_group("gloo")
rank = dist.get_rank()
_destroy = dist.destroy_process_group
#: The batch's own meeting point: a job that went wrong on purpose may leave a collective
#: of one rank pending on the default group, which a barrier there would pair with.
_meet = dist.new_group(backend="gloo")


def _keep_the_group(group=None):
    """destroy_process_group() of the default group is the batch's, at its end."""
    if group is not None:
        _destroy(group)


dist.init_process_group = lambda *args, **kwargs: None
dist.destroy_process_group = _keep_the_group


def _fail(out, number, why):
    """The job's failure, in its folder for the test that asked for it; the batch ends."""
    text = "[batch] rank %d: job %d failed: %s" % (rank, number, why)
    print(text, file=sys.stderr, flush=True)
    with open(os.path.join(out, ".failed_%d" % rank), "w") as f:
        f.write(text)
    sys.exit(1)


for number, (script, out, *args) in enumerate(jobs):
    print("[batch] rank %d: job %d: %s %s" % (rank, number, script, " ".join(args)), flush=True)
    start = time.monotonic()
    sys.argv = [os.path.join(HERE, script), out, *args]
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (None, 0):
            _fail(out, number, "exit status %r" % (exc.code,))
    except BaseException:
        _fail(out, number, traceback.format_exc())
    dist.barrier(group=_meet)
    open(os.path.join(out, ".done_%d" % rank), "w").close()
    print("[batch] rank %d: job %d done in %.1f s" % (rank, number, time.monotonic() - start),
          flush=True)
_destroy()
