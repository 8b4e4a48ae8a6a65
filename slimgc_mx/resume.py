"""Periodic checkpoints of a training job, and resuming from the newest complete one.

    ckpt = slimgc_mx.resume.JobCheckpoints(args.checkpoint_dir, kv.rank, kv.num_workers)
    position = ckpt.restore(trainer, net)        # None on a fresh start, else what you saved
    ...
    if step % args.checkpoint_every == 0:
        ckpt.save(step, trainer, net, {"epoch": epoch, "step": step})

Every rank writes its own part of checkpoint DIR/step-NNNNNNNN (the kvstore's state,
which holds this worker's error-feedback residuals, the global weights, and the
position you give), each file atomically (temporary file, fsync, rename), then a marker.
A checkpoint is complete once every rank's marker is there; restore() takes the newest
complete one, so a checkpoint torn by a crash is never loaded. The last `keep` complete
checkpoints stay. Files hold data only (slimgc_mx/dataio.py and MXNet's .params format).
"""
import os
import re
import shutil

from . import dataio

_NAME = re.compile(r"^step-(\d{8})$")


class JobCheckpoints:
    """The checkpoints of one job in `directory`, seen from worker `rank` of `num_workers`."""

    def __init__(self, directory, rank, num_workers, keep=2):
        if keep < 1:
            raise ValueError("keep must be >= 1 checkpoints, got %r" % (keep,))
        self.directory = directory
        self.rank, self.num_workers, self.keep = rank, num_workers, keep
        os.makedirs(directory, exist_ok=True)

    def _path(self, step, what):
        return os.path.join(self.directory, "step-%08d" % step, "rank%d.%s" % (self.rank, what))

    def complete(self):
        """Steps of the complete checkpoints, oldest first."""
        steps = []
        for name in os.listdir(self.directory):
            m = _NAME.match(name)
            if m and all(os.path.exists(os.path.join(self.directory, name, "rank%d.done" % r))
                         for r in range(self.num_workers)):
                steps.append(int(m.group(1)))
        return sorted(steps)

    def save(self, step, trainer, net, position):
        """Write this rank's part of checkpoint `step`: trainer/kvstore state (flushing the
        global weights into the parameters first), the parameters, and `position`; returns
        the checkpoint's directory."""
        os.makedirs(os.path.dirname(self._path(step, "done")), exist_ok=True)
        try:  # a part left by an earlier attempt is incomplete until rewritten
            os.remove(self._path(step, "done"))
        except FileNotFoundError:
            pass
        trainer.save_states(self._path(step, "states"))  # atomic: dataio.write
        params = self._path(step, "params")
        net.save_parameters(params + ".tmp")
        _fsync(params + ".tmp")
        os.replace(params + ".tmp", params)
        dataio.write(self._path(step, "position"),
                     {"step": step, "num_workers": self.num_workers, "position": position})
        with open(self._path(step, "done") + ".tmp", "w") as f:
            f.write("%d\n" % step)
            f.flush()
            os.fsync(f.fileno())
        os.replace(self._path(step, "done") + ".tmp", self._path(step, "done"))
        self._prune()
        return os.path.dirname(self._path(step, "done"))

    def _prune(self):
        """Remove every checkpoint older than the last `keep` complete ones. No rank writes
        to those any more (a newer one is complete), so any rank may remove them whole."""
        steps = self.complete()
        if len(steps) < self.keep:
            return
        cutoff = steps[-self.keep]
        for name in os.listdir(self.directory):
            m = _NAME.match(name)
            if m and int(m.group(1)) < cutoff:
                shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)

    def restore(self, trainer, net):
        """Load the newest complete checkpoint into `net` and `trainer` and return the
        position saved with it (with its 'step'), or None when there is none."""
        steps = self.complete()
        if not steps:
            return None
        step = steps[-1]
        saved = dataio.read(self._path(step, "position"))
        if saved["num_workers"] != self.num_workers:
            raise ValueError("checkpoint %s was written by a job of %d worker%s; this job has "
                             "%d: resume with the same worker count, or start in another "
                             "directory" % (os.path.dirname(self._path(step, "done")),
                                            saved["num_workers"],
                                            "" if saved["num_workers"] == 1 else "s",
                                            self.num_workers))
        net.load_parameters(self._path(step, "params"))
        trainer.load_states(self._path(step, "states"))
        return dict(saved["position"], step=step,
                    path=os.path.dirname(self._path(step, "done")))


def _fsync(path):
    with open(path, "rb") as f:
        os.fsync(f.fileno())
