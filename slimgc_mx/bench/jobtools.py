"""What scripts/train.py (MXNet) and scripts/train_torch.py (PyTorch) share, free of either
framework: option types, the progress bar, the summary line and the JSON result."""
import argparse
import json
import os
import sys

import numpy as np

#: The models of both scripts, by --model name: bench/models.py builds them in Gluon,
#: bench/torch_models.py in PyTorch with the same tensors; here without either framework.
MODELS = ("cnn1d", "fc", "mlp", "resnet20", "vgg")


def load_shard(args, rank, num_workers):
    """(this worker's shard of --dataset, steps per epoch): the batches it holds, at most
    --steps; exits naming the sizes when a batch is larger than the shard."""
    from . import datasets
    layout = "image" if args.model in ("resnet20", "vgg") else "flat"
    data = datasets.load(args.dataset, rank=rank, num_workers=num_workers, seed=args.seed,
                         layout=layout, num_train=args.num_train, image_size=args.image_size)
    steps = data.steps_per_epoch(args.batch_size)
    if steps == 0:
        sys.exit("batch size %d is larger than a worker's shard (%d samples)"
                 % (args.batch_size, data.num_train_total // num_workers))
    if args.steps:
        steps = min(steps, args.steps)
    return data, steps


def comm_threshold(text):
    """--comm-threshold: 'auto', 'off', a size in bytes, or a saved CTTab decision (.json)."""
    t = text.strip()
    if t.lower() in ("auto", "off"):
        return t.lower()
    if t.lstrip("-").isdigit():
        v = int(t)
        if v < 0:
            raise argparse.ArgumentTypeError("byte count must be >= 0, got %d" % v)
        return v
    if os.path.isfile(t):
        return t
    raise argparse.ArgumentTypeError("expected auto, off, a byte count or the .json file of a "
                                     "saved CTTab decision (FILE.cttab.json of an earlier "
                                     "--json run), got %r" % text)


def positive_int(text):
    v = int(text)
    if v <= 0:
        raise argparse.ArgumentTypeError("must be > 0, got %d" % v)
    return v


def codec_options(items):
    """{'ratio': '0.1'} from ['ratio=0.1'] (--codec-option), or a usage error."""
    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name:
            sys.exit("--codec-option %r: expected NAME=VALUE, e.g. ratio=0.1" % item)
        out[name.strip()] = value.strip()
    return out


def fmt_bytes(n):
    """Bytes in binary units (KiB, MiB, GiB)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return ("%d %s" % (n, unit)) if unit == "B" else ("%.1f %s" % (n, unit))
        n /= 1024.0


def progress_bar(total, desc, enabled):
    """A tqdm bar on stderr; under the launcher its refreshes reach the terminal through it."""
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    if not enabled:
        return None
    tty = sys.stderr.isatty()
    return tqdm(total=total, desc=desc, leave=False, file=sys.stderr, dynamic_ncols=tty,
                ncols=None if tty else 100)


def summary_line(result, compressor):
    """'summary: final test acc ... | samples/s | comm threshold ... | pushed ...': the last
    line rank 0 prints; the last two only with SlimGC's stats."""
    stats = result.get("kvstore_stats")
    sps = result["samples_per_s"]
    summary = ["final test acc %.4f" % result["final_test_acc"],
               "%.1f samples/s (median step), %.1f overall"
               % (sps["median_step"] or 0.0, sps["overall"] or 0.0)]
    if stats:
        ct = stats.get("comm_threshold_bytes")
        phase = stats.get("comm_threshold_phase")
        if isinstance(ct, int):
            chosen = fmt_bytes(ct)
        elif compressor == "none":
            chosen = "n/a (compressor none)"
        else:
            chosen = "never"
        reason = stats.get("cttab_reason")
        summary.append("comm threshold %s%s%s" % (chosen, " (%s)" % phase if phase else "",
                                                ": " + reason if reason else ""))
        pushed, pulled, fp32 = (stats.get(k) for k in ("bytes_pushed", "bytes_pulled",
                                                       "bytes_fp32"))
        if pushed is not None and fp32:
            summary.append("pushed %s, pulled %s vs %s fp32 (%.1f%% / %.1f%%)"
                           % (fmt_bytes(pushed), fmt_bytes(pulled or 0), fmt_bytes(fp32),
                              100.0 * pushed / fp32, 100.0 * (pulled or 0) / fp32))
    return "summary: " + " | ".join(summary)


def write_results(result, path, is_root, num_workers):
    """--json: rank 0 writes FILE; every rank of a multi-worker job FILE-stem.rankN.json."""
    write_json(result, path if is_root else None)
    if num_workers > 1:
        stem, ext = os.path.splitext(path)
        write_json(result, "%s.rank%d%s" % (stem, result["rank"], ext or ".json"))


def write_json(result, path):
    """Write atomically (rank 0: FILE; every rank of a multi-worker job: FILE.rankN)."""
    if path is None:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = "%s.tmp%d" % (path, os.getpid())  # workers of a no-comm run share the path
    with open(tmp, "w") as f:
        json.dump(result, f, indent=2, default=_json_default)
    os.replace(tmp, path)


def _json_default(o):
    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    return str(o)
