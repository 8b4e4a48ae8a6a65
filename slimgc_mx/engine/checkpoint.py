"""The kvstore's checkpoint: composed from each part's own state, in a data-only file.

Saved: the settings that must agree, the worker count, the global and local optimizers
(class, settings, scheduler state, counters) and their per-index states, per key its
step, error-feedback residual and codec state (planner), the compressed buckets' codec
states, glo_buf with version and flag (backup), the CTTab decision, and the transfer
counters. The file is a NumPy archive plus a JSON document (dataio.py): reading it runs
no code. Every part is checked against this job before any is restored, so a bad file
changes nothing. A pickle of the first format is refused: loading it would run whatever
it says.
"""
import dataclasses

import numpy as np

from .. import dataio

FORMAT = "slimgc-checkpoint"
VERSION = 2


def save(fname, agg):
    """Write everything a resumed job needs; the caller has flushed the aggregator."""
    dataio.write(fname, state(agg))


def state(agg):
    """Everything a resumed job needs, as data (arrays and plain values)."""
    return {
        "format": FORMAT,
        "version": VERSION,
        "settings": agg.config.agreement_fields(),
        "num_workers": agg.num_workers,
        "optimizer": agg.optimizer_state(),
        "keys": agg.planner.state_dict(),
        "buckets": agg.planner.bucket_state(),
        "backup": agg.backup.state_dict(),
        "cttab": agg.cttab.state_dict(),
        "counters": dataclasses.asdict(agg.stats),
    }


def read(fname, agg):
    """The checkpoint in `fname`, checked against this job; a ValueError says why not."""
    try:
        state = dataio.read(fname)
    except dataio.DataFileError as exc:
        if _is_pickle(fname):
            raise ValueError(
                "%s is a pickle, as slimgc checkpoints of the first format were: loading it "
                "would run whatever code it holds, so slimgc_mx reads only its data-only "
                "format (save the checkpoint again with this version)" % fname) from None
        raise ValueError("%s is not a slimgc checkpoint: %s" % (fname, exc)) from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ValueError("%s is a data file but not a slimgc checkpoint (format %r)"
                         % (fname, state.get("format") if isinstance(state, dict) else None))
    if state.get("version") != VERSION:
        raise ValueError("%s is a slimgc checkpoint of version %r; this slimgc_mx reads "
                         "version %d" % (fname, state.get("version"), VERSION))
    check(state, agg, "checkpoint %s" % fname)
    return state


def load(state, agg, where="checkpoint"):
    """Restore every part from a checkpoint read(); the pipeline must be idle."""
    agg.load_optimizer_state(state["optimizer"], where)
    agg.planner.load_state_dict(state["keys"])
    agg.backup.load_state_dict(state["backup"])
    agg.cttab.load_state_dict(state["cttab"])
    agg.planner.refuse_stale_buckets()
    agg.planner.load_bucket_state(state.get("buckets", []))
    for name, value in state["counters"].items():
        setattr(agg.stats, name, value)


def check(state, agg, where):
    """Everything that can be checked before restoring anything; a ValueError names it."""
    mine = agg.config.agreement_fields()
    for name, value in state["settings"].items():
        if name == "lane_dtype":  # how sums travel, not what the job holds
            continue
        if mine.get(name) != value:
            raise ValueError("%s was written with %s=%r but this job uses %r"
                             % (where, name, value, mine.get(name)))
    keys = agg.planner.keys
    if state["num_workers"] != agg.num_workers:
        raise ValueError("%s holds %d workers, this job has %d: the world sizes differ "
                         "(saved %d, now %d); resume with as many workers as saved it"
                         % (where, state["num_workers"], agg.num_workers,
                            state["num_workers"], agg.num_workers))
    if set(state["keys"]) != set(keys):
        raise ValueError("%s holds keys %s; this job has keys %s: a checkpoint of another "
                         "model" % (where, sorted(map(repr, state["keys"])),
                                    sorted(map(repr, keys))))
    for key, b in keys.items():
        saved, glo = state["keys"][key], state["backup"][key]["glo_buf"]
        memory = b.codec.memory_size(b.size) if b.codec is not None else b.size
        if np.size(glo) != b.size or saved["residual"] is not None and (
                np.size(saved["residual"]) != memory):
            raise ValueError("%s: key %r holds %d values, this job's has shape %s: "
                             "a checkpoint of another model" % (where, key, np.size(glo),
                                                                b.shape))
        if b.codec is not None:
            b.codec.clone().load_state_dict(saved["codec"])  # raises on another codec's state
    agg.update.check_state(state["optimizer"]["global"], where)


def _is_pickle(fname):
    with open(fname, "rb") as f:
        return f.read(1) == b"\x80"
