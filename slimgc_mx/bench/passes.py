"""Memory traffic per step that the pipeline's plan implies, against its floor and no-comm.

`python -m slimgc_mx.bench passes --model fc` lists every pass the CPU makes over a
model's weights in one step of full SlimGC (the gradient copy, the local update and its
write into the parameters, the NaN pre-check, the encode, the finisher's check of the
sum, the decode and the global update, as far as they are separate passes) with the
bytes each reads and writes per element, from the same decisions the kvstore makes:
which tensors the threshold compresses (`--comm-threshold`), whether the local update
encodes in its own pass (Traits.fuses_local_update) or counts NaN/Inf so the encoder
skips its own check (Planner.checks_in_local_update), and whether the SGD kernel
decodes the lanes inside its update (GlobalUpdate.decodes_in_update: MXNet's SGD and a
codec that decodes by table). The floor is what a step must touch at least (read the
gradient, the residual and glo_buf, write the lanes and the parameters; on the
aggregation side the lanes, the momentum and glo_buf); no-comm is one SGD step. A copy
of the weights is 8 bytes per element (read and write), the unit the table reports
beside bytes.
"""
import argparse
import json
import sys
from dataclasses import asdict, dataclass

DESCRIPTION = "bytes of memory traffic per element and step the pipeline's plan implies"

#: Bytes per element of one float32 copy (read + write): the report's unit.
COPY = 8.0


@dataclass
class Pass:
    """One pass over a tensor's elements: where it runs, bytes read and written per element."""

    name: str
    where: str
    read: float
    write: float

    @property
    def total(self):
        return self.read + self.write


def compressed_passes(wire_bits, backup=True, momentum=True, fused_decode=True,
                      fused_encode=True):
    """The passes of a compressed tensor after warm-up, in pipeline order. fused_encode:
    with backup, the codec encodes inside the local update's pass (fuses_local_update),
    which reads MXNet's gradient in place (a gradient in MKLDNN's layout would still be
    copied into grad_buf first; kv.stats() counts the keys read in place)."""
    lanes = wire_bits / 8.0
    state = 4.0 if momentum else 0.0  # the momentum, read and written by an update
    if backup and fused_encode:
        out = [Pass("local update + encode, one pass", "grad_buf.FusedEncode (SGD kernel)",
                    12 + state, 8 + lanes),
               Pass("loc_buf into the parameters", "backup.local_step", 4, 4)]
    else:
        out = [Pass("gradient into grad_buf", "aggregator.push (copy_array)", 4, 4)]
        if backup:
            out += [Pass("local update (counts NaN/Inf)", "update.LocalUpdater (SGD kernel)",
                         8 + state, 4),
                    Pass("loc_buf into the parameters", "backup.local_step", 4, 4)]
        else:
            out += [Pass("NaN/Inf pre-check", "codec.encode (read-only pass)", 4, 0)]
        out += [Pass("encode (error feedback, levels, lanes)", "codec.encode", 8, 4 + lanes)]
    if fused_decode:
        out += [Pass("sum checked: NaN/Inf and lanes in range", "pipeline (finisher)",
                     lanes, 0),
                Pass("decode inside the global update", "update.GlobalUpdate (SGD kernel)",
                     lanes + 4 + state, 4 + state)]
    else:
        out += [Pass("sum checked for NaN/Inf", "pipeline (finisher)", lanes, lanes / 8),
                Pass("decode into the aggregate", "codec.decode", lanes, 4),
                Pass("global update", "update.GlobalUpdate", 8 + state, 4 + state)]
    if not backup:
        out += [Pass("glo_buf into the parameters", "backup.write_back", 4, 4)]
    return out


def full_precision_passes(backup=True, momentum=True):
    """The passes of a full-precision tensor (fp_buf is grad_buf; the aggregate comes back)."""
    state = 4.0 if momentum else 0.0
    out = [Pass("gradient into grad_buf", "aggregator.push (copy_array)", 4, 4)]
    if backup:
        out += [Pass("local update", "update.LocalUpdater", 8 + state, 4),
                Pass("loc_buf into the parameters", "backup.local_step", 4, 4)]
    out += [Pass("send fp_buf, receive the sum", "transport (MXNet's kvstore)", 4, 4),
            Pass("global update", "update.GlobalUpdate", 8 + state, 4 + state)]
    if not backup:
        out += [Pass("glo_buf into the parameters", "backup.write_back", 4, 4)]
    return out


def floor_bytes(wire_bits, momentum=True):
    """What any step with backup must touch per compressed element (docs/benchmarks.md)."""
    lanes = wire_bits / 8.0
    state = 8.0 if momentum else 0.0
    push = 4 + 8 + 4 + state / 2 + lanes + 4  # gradient, residual r/w, glo, momentum, lanes, params
    aggregate = lanes + state + 8  # lanes, momentum r/w, glo_buf r/w
    return push + aggregate


def no_comm_bytes(momentum=True):
    """One SGD step: read the gradient, read and write the weight (and the momentum)."""
    return 4 + 8 + (8 if momentum else 0)


def plan(sizes, codec, num_workers, comm_threshold, backup=True, momentum=True):
    """The report of a model whose tensors hold `sizes` elements under `codec`."""
    bits = codec.wire_bits_per_element(num_workers)
    fused = codec.traits.decodes_by_table  # with MXNet's SGD, the only optimizer this plan models
    encode_fused = (backup and codec.traits.fuses_local_update
                    and not codec.traits.wants_optimizer)
    comp = [n for n in sizes if 4 * n >= comm_threshold]
    full = [n for n in sizes if 4 * n < comm_threshold]
    c_passes = compressed_passes(bits, backup, momentum, fused, encode_fused)
    f_passes = full_precision_passes(backup, momentum)
    total = sum(sizes)
    bytes_step = sum(comp) * sum(p.total for p in c_passes) \
        + sum(full) * sum(p.total for p in f_passes)
    return {"elements": total, "compressed_elements": sum(comp), "wire_bits": bits,
            "decode_in_update": fused, "encode_in_local_update": encode_fused,
            "backup": backup, "momentum": momentum,
            "compressed_passes": [dict(asdict(p), total=p.total) for p in c_passes],
            "full_precision_passes": [dict(asdict(p), total=p.total) for p in f_passes],
            "bytes_per_element": bytes_step / total if total else 0.0,
            "floor_bytes_per_element": floor_bytes(bits, momentum),
            "no_comm_bytes_per_element": no_comm_bytes(momentum),
            "bytes_per_step": bytes_step}


def format_report(name, r):
    lines = ["%s: %.1f M elements, %.1f M compressed (%.2f wire bits per element); encode "
             "inside the local update: %s; decode inside the update: %s; backup: %s" % (
                 name, r["elements"] / 1e6, r["compressed_elements"] / 1e6, r["wire_bits"],
                 "yes" if r["encode_in_local_update"] else "no",
                 "yes" if r["decode_in_update"] else "no", "on" if r["backup"] else "off"),
             "", "%-40s %-36s %6s %6s %6s" % ("pass over a compressed tensor", "where",
                                              "read", "write", "copies")]
    for p in r["compressed_passes"]:
        lines.append("%-40s %-36s %6.2f %6.2f %6.2f" % (p["name"], p["where"], p["read"],
                                                       p["write"], p["total"] / COPY))
    lines += ["", "bytes per element and step: %.1f (%.1f copies); floor %.1f (%.1f copies); "
              "no-comm %.1f (%.1f copies)" % (
                  r["bytes_per_element"], r["bytes_per_element"] / COPY,
                  r["floor_bytes_per_element"], r["floor_bytes_per_element"] / COPY,
                  r["no_comm_bytes_per_element"], r["no_comm_bytes_per_element"] / COPY),
              "per step: %.0f MB of memory traffic outside forward and backward"
              % (r["bytes_per_step"] / 1e6)]
    return "\n".join(lines)


def model_sizes(model, dataset):
    """Element counts of a training model's parameters (bench.models; imports MXNet)."""
    import mxnet as mx

    from . import datasets, models
    layout = "image" if model in ("resnet20", "vgg") else "flat"
    input_shape, num_classes = datasets.info(dataset, layout)
    net = models.get_model(model, num_classes, input_shape)
    net.initialize(mx.init.Xavier())
    net(mx.nd.zeros((1,) + tuple(input_shape)))
    return [int(p.data().size) for p in net.collect_params().values()]


def parse_args(argv, prog):
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="fc", help="bench model (default: fc)")
    p.add_argument("--dataset", default="synthetic-cifar",
                   help="the model's dataset, for its input shape (default: synthetic-cifar)")
    p.add_argument("--compressor", default="2bit", help="codec (default: 2bit)")
    p.add_argument("--workers", type=int, default=2, help="worker count N (default: 2)")
    p.add_argument("--comm-threshold", type=int, default=160 * 1024,
                   help="tensors of at least this many bytes are compressed (default: "
                        "163840, fc's BestCT in docs/results.md)")
    p.add_argument("--no-backup", action="store_true", help="model backup off")
    p.add_argument("--no-momentum", action="store_true", help="plain SGD")
    p.add_argument("--json", metavar="FILE", help="write the report here")
    return p.parse_args(argv)


def main(argv=None, prog="python -m slimgc_mx.bench passes"):
    from .. import codecs
    args = parse_args(sys.argv[1:] if argv is None else argv, prog)
    if args.workers < 1:
        raise SystemExit("--workers must be >= 1, got %d" % args.workers)
    codec = codecs.create(args.compressor)
    report = plan(model_sizes(args.model, args.dataset), codec, args.workers, args.comm_threshold,
                  backup=not args.no_backup, momentum=not args.no_momentum)
    print(format_report(args.model, report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0
