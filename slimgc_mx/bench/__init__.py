"""Benchmarks: `python -m slimgc_mx.bench SUBCOMMAND [ARGS...]`.

Each subcommand is a module with DESCRIPTION and main(argv, prog); add one to SUBCOMMANDS.
"""
import importlib
import sys

#: subcommand -> module implementing it
SUBCOMMANDS = {
    "codecs": "slimgc_mx.bench.codecs",
    "cluster": "slimgc_mx.bench.cluster",
    "faults": "slimgc_mx.bench.faults",
    "gpu": "slimgc_mx.bench.gpu",
    "passes": "slimgc_mx.bench.passes",
    "scale": "slimgc_mx.bench.scale",
    "small-keys": "slimgc_mx.bench.small_keys",
}

PROG = "python -m slimgc_mx.bench"


def usage():
    lines = ["usage: %s {%s} [ARGS...]" % (PROG, ",".join(SUBCOMMANDS)), "", "subcommands:"]
    for name, module in SUBCOMMANDS.items():
        lines.append("  %-10s %s" % (name, importlib.import_module(module).DESCRIPTION))
    lines.append("")
    lines.append("`%s SUBCOMMAND --help` lists a subcommand's options." % PROG)
    return "\n".join(lines)


def main(argv=None):
    """Dispatch to a subcommand; returns the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print("%s: unknown subcommand %r\n\n%s" % (PROG, name, usage()), file=sys.stderr)
        return 2
    module = importlib.import_module(SUBCOMMANDS[name])
    return module.main(rest, prog="%s %s" % (PROG, name))
