"""The kvstore's checkpoint: composed from each part's own state_dict.

Saved: the settings that must agree, the worker count, the global and local optimizer
states (MXNet Updater format), per key its step, error-feedback residual and codec
state (planner), glo_buf with version and flag (backup), the CTTab decision, and the
transfer counters.
"""
import dataclasses
import pickle

FORMAT = "slimgc-checkpoint-1"


def save(fname, agg, dump_optimizer=False):
    """Write everything a resumed job needs; the caller has flushed the aggregator."""
    local = agg.local_state()
    state = {
        "format": FORMAT,
        "settings": agg.config.agreement_fields(),
        "num_workers": agg.num_workers,
        "global": agg.update.get_states(dump_optimizer),
        "local": local,
        "keys": agg.planner.state_dict(),
        "buckets": agg.planner.bucket_state(),
        "backup": agg.backup.state_dict(),
        "cttab": agg.cttab.state_dict(),
        "counters": dataclasses.asdict(agg.stats),
    }
    with open(fname, "wb") as f:
        pickle.dump(state, f)


def read(fname, agg):
    """The checkpoint in `fname`, checked against this job; a ValueError says why not."""
    with open(fname, "rb") as f:
        state = pickle.load(f)
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ValueError("%s is not a slimgc checkpoint (format %r); it was not written by "
                         "SlimGC.save_optimizer_states" % (fname, FORMAT))
    mine = agg.config.agreement_fields()
    for name, value in state["settings"].items():
        if mine.get(name) != value:
            raise ValueError("checkpoint %s was written with %s=%r but this job uses %r"
                             % (fname, name, value, mine.get(name)))
    keys = agg.planner.keys
    if state["num_workers"] != agg.num_workers or set(state["keys"]) != set(keys):
        raise ValueError("checkpoint %s holds %d workers and keys %s; this job has %d "
                         "workers and keys %s" % (fname, state["num_workers"],
                                                  sorted(state["keys"]), agg.num_workers,
                                                  sorted(keys)))
    return state


def load(state, agg):
    """Restore every part from a checkpoint read(); the pipeline must be idle."""
    agg.load_optimizer_states(state["global"], state["local"])
    agg.planner.load_state_dict(state["keys"])
    agg.backup.load_state_dict(state["backup"])
    agg.cttab.load_state_dict(state["cttab"])
    agg.planner.refuse_stale_buckets()
    agg.planner.load_bucket_state(state.get("buckets", []))
    for name, value in state["counters"].items():
        setattr(agg.stats, name, value)
