"""SlimGCConfig: every option of the kvstore, validated once, from one of three sources.

The rule (docs/configuration.md, "Where a setting comes from"): the script's explicit
parameters (constructor keywords, Trainer's `compression_params`) win over SLIMGC_*
environment variables (read through env.py), which win over the defaults. A variable
that loses is said out loud, once; codec options set in the environment for a codec that
lost go with it.
"""
import dataclasses
import math
import threading
import warnings
from typing import Optional, Union

from .. import codecs, env, notice
from .lanes32 import LANE_DTYPES
from .cttab import check_rule, load_decision

# A buffer larger than this travels as pieces of at most this many bytes, each its own
# wire key (0: whole). MXNet's dist_sync answers a pull only after every worker's push of
# that key, so with pieces the first sums flow back while later pieces are still pushed,
# and a worker's link carries both directions at once.
PIECE_BYTES = 1 << 20
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}
_BOOL_FIELDS = ("backup", "offload", "fuse", "stream")
_WARNED = set()  # SLIMGC_* variables already warned about


@dataclasses.dataclass
class SlimGCConfig:
    """Options of the SlimGC kvstore (see docs/configuration.md).

    compressor      codec name (codecs.available(): none, 1bit, 2bit, 4bit, ...)
    codec_options   the codec's own options, e.g. {'levels': 8} for qsgd (docs/codecs.md)
    seed            the job's seed of stochastic rounding (every worker draws alike)
    threshold       the codec's threshold (2bit: t; 1bit and 4bit validate it but do not use it)
    comm_threshold  'auto' (warm-up builds the CTTab), a size in bytes (tensors of at least
                    that many bytes are compressed), 'off' (compress every tensor), or the
                    path of a saved CTTab decision (PREFIX.json of CTTab.save) to replay
    warmup_steps    warm-up steps of the CTTab (alternating compressed / full precision)
    cttab_rule      how BestCT is read from the CTTab: 'fit' (times of a link fitted to
                    all transfers) or 'measured' (each size's own times, as in the paper)
    cttab_margin    a size is compressed only if its benefit ratio is at least 1 + margin,
                    so a benefit within the noise of 1 does not flip between runs
    backup          model backup: loc_buf/glo_buf, the next step starts before aggregation ends
    offload         encode/decode on CPU threads with the Cython codecs (False: with the
                    framework's ops on the gradient's device; 'auto': the CTTab's warm-up
                    measures both and chooses per tensor, where the model is on a GPU)
    fuse            after the CTTab's decision, send the full-precision tensors as one
                    flat buffer per server and update them with one optimizer call
    fuse_compressed compressed tensors below this many bytes share one compressed bucket
                    ('auto': the size the CTTab's fit gives; 'off'; or a number of bytes)
    loc_lr          learning rate of the local update (default: the global optimizer's)
    loc_optimizer   optimizer name of the local update (default: a copy of the global one)
    num_threads     CPU threads of the codecs and the SGD kernel (default: all cores)
    timeout         seconds the training thread waits for one aggregation before it raises
    audit_every     compare global-weight checksums across workers every K steps (0: off)
    piece_bytes     dist transport: buffers larger than this go as pieces of this many bytes,
                    so the sums of the first pieces come back while later ones are pushed (0: whole)
    stream          a compressed key whose local update encodes it (2bit) is encoded piece by
                    piece, and each piece is pushed as soon as it is encoded (needs piece_bytes)
    trace           write each worker's stage spans to this Chrome trace file (FILE.rankN.json;
                    docs/trace.md); None: no trace
    lane_dtype      what lane codecs' sums travel as: 'float64' (servers must sum float64
                    exactly), 'float32' (exact on any server, more bytes), 'auto' (float64
                    when the start-up probe finds every server exact, else float32)
    """

    compressor: str = "2bit"
    codec_options: dict = dataclasses.field(default_factory=dict)
    seed: int = 0
    threshold: float = 0.5
    comm_threshold: Union[str, int] = "auto"
    warmup_steps: int = 20
    cttab_rule: str = "fit"
    cttab_margin: float = 0.5
    backup: bool = True
    offload: Union[bool, str] = True
    fuse: bool = True
    fuse_compressed: Union[str, int] = "off"
    loc_lr: Optional[float] = None
    loc_optimizer: Optional[str] = None
    num_threads: Optional[int] = None
    timeout: float = 600.0
    audit_every: int = 0
    piece_bytes: int = PIECE_BYTES
    stream: bool = True
    trace: Optional[str] = None
    lane_dtype: str = "auto"

    def __post_init__(self):
        self.validate()

    @classmethod
    def field_names(cls):
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_sources(cls, options=None, environ=None, source="keyword arguments"):
        """Build from SLIMGC_* variables in `environ`, overridden by `options` (a dict of the
        script's explicit parameters, named `source` in messages).

        A SLIMGC_* variable that names no option is warned about, once, with the closest
        valid name; one that an explicit parameter overrides is told once (notice.tell).
        """
        for var, close in env.unknown_variables(cls.field_names(), environ):
            if var not in _WARNED:
                _WARNED.add(var)
                warnings.warn("%s is not a slimgc option and is ignored%s" % (
                    var, "; did you mean %s?" % close if close else
                    " (docs/configuration.md lists the SLIMGC_* variables)"), stacklevel=3)
        raw = env.option_variables(cls.field_names(), environ)
        values = {name: _parse(name, text, env.OPTION_PREFIX + name.upper())
                  for name, text in raw.items()}
        explicit = normalize_options(options or {})
        values, messages = _merge(values, raw, explicit, options or {}, source)
        _check_none_takes_no_options(values.get("compressor", "2bit"), explicit, source)
        for message in messages:
            notice.tell(message, once=True)
        return cls(**values)

    def replace(self, options):
        """A copy with `options` (a dict, e.g. Trainer's compression_params) applied."""
        return dataclasses.replace(self, **normalize_options(options))

    def validate(self):
        if self.compressor not in codecs.available():
            raise ValueError("unknown compressor %r; valid: %s"
                             % (self.compressor, ", ".join(codecs.available())))
        if not isinstance(self.codec_options, dict):
            raise ValueError("codec_options must be a dict, got %r" % (self.codec_options,))
        try:
            self.codec_options = codecs.create(self.compressor,
                                               **self.codec_options).option_values
        except ValueError as exc:
            unknown = set(self.codec_options) - set(codecs.option_names(self.compressor))
            hint = did_you_mean(sorted(unknown)[0], self.compressor) if unknown else ""
            if not hint:
                raise
            raise ValueError("%s%s" % (exc, hint)) from None
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError("seed must be an integer >= 0, got %r" % (self.seed,))
        if not (isinstance(self.threshold, (int, float)) and math.isfinite(self.threshold)
                and self.threshold > 0):
            raise ValueError("threshold must be a positive finite number, got %r"
                             % (self.threshold,))
        ct = self.comm_threshold
        if isinstance(ct, str):
            if ct not in ("auto", "off"):
                load_decision(ct)  # a saved decision to replay; a ValueError says what is wrong
        elif isinstance(ct, bool) or not isinstance(ct, int) or ct < 0:
            raise ValueError("comm_threshold must be 'auto', 'off' or a non-negative size "
                             "in bytes, got %r" % (ct,))
        if not isinstance(self.warmup_steps, int) or self.warmup_steps < 2:
            raise ValueError("warmup_steps must be an integer >= 2 (one compressed and one "
                             "full-precision step per key), got %r" % (self.warmup_steps,))
        check_rule(self.cttab_rule)
        if (isinstance(self.cttab_margin, bool) or not isinstance(self.cttab_margin, (int, float))
                or not (0 <= self.cttab_margin < 100)):
            raise ValueError("cttab_margin must be a number >= 0 (0.25: compress a size only when "
                             "it is at least 25 %% faster compressed), got %r"
                             % (self.cttab_margin,))
        for name in _BOOL_FIELDS:
            if name == "offload" and self.offload == "auto":
                continue
            if not isinstance(getattr(self, name), bool):
                raise ValueError("%s must be True or False, got %r (strings such as 'off' "
                                 "are parsed by from_sources() and replace())"
                                 % (name, getattr(self, name)))
        fc = self.fuse_compressed
        if not (fc in ("auto", "off") or isinstance(fc, int) and not isinstance(fc, bool)
                and fc >= 0):
            raise ValueError("fuse_compressed must be 'auto', 'off' or a size in bytes, got %r"
                             % (fc,))
        if self.loc_lr is not None and not (math.isfinite(self.loc_lr) and self.loc_lr > 0):
            raise ValueError("loc_lr must be a positive finite number, got %r" % (self.loc_lr,))
        if self.num_threads is not None and (not isinstance(self.num_threads, int)
                                             or self.num_threads < 1):
            raise ValueError("num_threads must be an integer >= 1, got %r" % (self.num_threads,))
        if not (0 < self.timeout <= threading.TIMEOUT_MAX):
            raise ValueError("timeout must be positive seconds no larger than %.3g, got %r "
                             "(for a very long wait give e.g. 86400)"
                             % (threading.TIMEOUT_MAX, self.timeout))
        if not isinstance(self.audit_every, int) or self.audit_every < 0:
            raise ValueError("audit_every must be an integer >= 0, got %r" % (self.audit_every,))
        if (isinstance(self.piece_bytes, bool) or not isinstance(self.piece_bytes, int)
                or not (self.piece_bytes == 0 or self.piece_bytes >= 8)):
            raise ValueError("piece_bytes must be 0 (send buffers whole) or an integer >= 8 "
                             "bytes, got %r" % (self.piece_bytes,))
        if self.lane_dtype not in LANE_DTYPES:
            raise ValueError("lane_dtype must be one of %s, got %r"
                             % (", ".join(LANE_DTYPES), self.lane_dtype))

    def agreement_fields(self):
        """The settings that must be identical on every worker."""
        return {"compressor": self.compressor, "codec_options": self.codec_options,
                "seed": self.seed, "threshold": float(self.threshold),
                "comm_threshold": self._comm_threshold_agreed(), "warmup_steps": self.warmup_steps,
                "cttab_margin": float(self.cttab_margin),
                "backup": self.backup, "offload": self.offload, "fuse": self.fuse,
                "fuse_compressed": self.fuse_compressed,
                "piece_bytes": self.piece_bytes, "lane_dtype": self.lane_dtype}

    def _comm_threshold_agreed(self):
        """comm_threshold as workers compare it: a replayed file by the decision it holds."""
        ct = self.comm_threshold
        if isinstance(ct, str) and ct not in ("auto", "off"):
            return "saved decision %s" % (load_decision(ct)["best_ct"],)
        return ct


# Trainer's compression_params follows MXNet's {'type': '2bit', 'threshold': 0.5}.
_ALIASES = {"type": "compressor"}


def normalize_options(options):
    """Map MXNet-style keys to field names, parse strings, reject unknown names.

    A key that is an option of the chosen codec (or of any codec) goes to codec_options.
    """
    valid = SlimGCConfig.field_names()
    codec_keys = {name for codec in codecs.available() for name in codecs.option_names(codec)}
    out = {}
    for key, value in dict(options).items():
        name = _ALIASES.get(key, key)
        if name not in valid and key in codec_keys:
            out.setdefault("codec_options", {})[key] = value
            continue
        if name not in valid:
            raise ValueError("unknown SlimGC option %r; valid: %s, or a codec's own option (%s)%s"
                             % (key, ", ".join(["type"] + valid),
                                ", ".join(sorted(codec_keys)) or "none",
                                did_you_mean(key, options.get("type", options.get(
                                    "compressor")))))
        out[name] = _parse(name, value, repr(key)) if isinstance(value, str) else value
    if isinstance(out.get("comm_threshold"), float) and out["comm_threshold"].is_integer():
        out["comm_threshold"] = int(out["comm_threshold"])
    return out


def did_you_mean(name, compressor=None):
    """'; did you mean X?' for the setting or option of `compressor` closest to the
    misspelt `name` (every codec's options when it names none), else ''."""
    import difflib
    chosen = [compressor] if compressor in codecs.available() else codecs.available()
    names = SlimGCConfig.field_names() + [o for c in chosen for o in codecs.option_names(c)]
    close = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
    return "; did you mean %s?" % close[0] if close else ""


def _check_none_takes_no_options(compressor, explicit, source):
    """Refuse a threshold or codec option given explicitly with compressor 'none', which
    would drop it without a word; the environment's are not refused, as it may serve jobs
    of several codecs."""
    if compressor != "none":
        return
    given = dict(explicit.get("codec_options") or {})
    if "threshold" in explicit:
        given["threshold"] = explicit["threshold"]
    if given:
        raise ValueError("compressor 'none' takes no codec options: %s given in %s; it sends "
                         "full precision, so drop them, or choose a codec that takes them"
                         % (", ".join("%s=%r" % kv for kv in sorted(given.items())), source))


def _merge(values, raw, explicit, given, source):
    """The environment's parsed `values` (`raw` as set) under the `explicit` parameters
    (`given` as the script wrote them): (merged values, a message per variable that lost).

    Codec options merge by name; those of an environment compressor that the script
    replaced go with it. One the final codec does not have raises, naming its variable."""
    merged, messages = dict(values), []
    for name, value in explicit.items():
        if name in values and name != "codec_options" and value != values[name]:
            messages.append("%s%s=%s is overridden by %s %s" % (
                env.OPTION_PREFIX, name.upper(), raw[name], source, _given(name, value, given)))
    env_opts, mine = values.get("codec_options") or {}, explicit.get("codec_options") or {}
    replaced = "compressor" in values and explicit.get("compressor", values["compressor"]) \
        != values["compressor"]
    if env_opts and replaced:
        messages.append("%sCODEC_OPTIONS=%s goes with %sCOMPRESSOR=%s, which %s %s overrides: "
                        "those codec options are not used" % (
                            env.OPTION_PREFIX, raw["codec_options"], env.OPTION_PREFIX,
                            raw["compressor"], source,
                            _given("compressor", explicit["compressor"], given)))
        env_opts = {}
    for name in sorted(set(env_opts) & set(mine)):
        if str(mine[name]) != str(env_opts[name]):
            messages.append("%sCODEC_OPTIONS %s=%s is overridden by %s %s=%r" % (
                env.OPTION_PREFIX, name, env_opts[name], source, name, mine[name]))
    merged.update(explicit)
    merged["codec_options"] = {**env_opts, **mine}
    where = ("%s %s" % (source, _given("compressor", explicit["compressor"], given))
             if "compressor" in explicit else "%sCOMPRESSOR=%s" % (
                 env.OPTION_PREFIX, raw["compressor"]) if "compressor" in raw else "the default")
    _check_environment_codec_options(env_opts, merged.get("compressor", "2bit"), raw, where)
    return merged, messages


def _given(name, value, given):
    """How the script wrote option `name` (its own key, e.g. 'type' for the compressor)."""
    for key in given:
        if _ALIASES.get(key, key) == name:
            return "%s=%r" % (key, given[key])
    return "%s=%r" % (name, value)


def _check_environment_codec_options(env_opts, compressor, raw, where):
    """A codec option set in the environment that the chosen codec (chosen by `where`) does
    not have is an error naming the variable, not a codec's bare refusal."""
    if compressor not in codecs.available():
        return  # validate() names the unknown compressor
    unknown = sorted(set(env_opts) - set(codecs.option_names(compressor)))
    if unknown:
        raise ValueError("%sCODEC_OPTIONS=%s sets %s, which codec %r (%s) does not have "
                         "(its options: %s); unset the variable or choose the codec it was "
                         "meant for" % (env.OPTION_PREFIX, raw["codec_options"],
                                        ", ".join(unknown), compressor, where,
                                        ", ".join(codecs.option_names(compressor)) or "none"))


def _parse(name, raw, where):
    """Parse one option given as a string (environment or CLI)."""
    raw = raw.strip()
    try:
        if name in _BOOL_FIELDS:
            low = raw.lower()
            if name == "offload" and low == "auto":
                return low
            if low in _TRUE:
                return True
            if low in _FALSE:
                return False
            raise ValueError
        if name in ("threshold", "timeout", "loc_lr", "cttab_margin"):
            return float(raw)
        if name in ("warmup_steps", "num_threads", "audit_every", "piece_bytes", "seed"):
            return int(raw)
        if name == "codec_options":  # SLIMGC_CODEC_OPTIONS=levels=8,bucket_size=256
            pairs = [item.partition("=") for item in raw.split(",") if item.strip()]
            if any(not sep or not k.strip() for k, sep, _ in pairs):
                raise ValueError
            return {k.strip(): v.strip() for k, _, v in pairs}
        if name == "lane_dtype":
            return raw.lower()
        if name == "fuse_compressed":
            return raw.lower() if raw.lower() in ("auto", "off") else int(raw)
        if name == "comm_threshold":
            if raw.lower() in ("auto", "off"):
                return raw.lower()
            return int(raw) if raw.isdigit() else raw  # else: a saved decision's path
        return raw
    except ValueError:
        raise ValueError("cannot parse %s=%r for option %r: expected %s"
                         % (where, raw, name, _EXPECTED.get(name, "a string"))) from None


_BOOL = "1/0, true/false, yes/no or on/off"
_EXPECTED = {**{name: _BOOL for name in _BOOL_FIELDS}, "offload": _BOOL + " or auto",
             "threshold": "a number", "timeout": "a number of seconds", "loc_lr": "a number",
             "warmup_steps": "an integer", "num_threads": "an integer", "audit_every": "an integer",
             "piece_bytes": "an integer number of bytes",
             "cttab_margin": "a number", "seed": "an integer",
             "fuse_compressed": "'auto', 'off' or a size in bytes",
             "lane_dtype": "auto, float64 or float32",
             "codec_options": "NAME=VALUE pairs separated by commas",
             "comm_threshold": "'auto', 'off', a size in bytes or a saved CTTab file"}
