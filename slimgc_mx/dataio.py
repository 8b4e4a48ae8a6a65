"""Data-only files: a tree of dicts, lists, numbers, strings and NumPy arrays in one .npz.

Arrays are stored as the archive's members; everything else as one JSON document inside
it. Reading uses np.load(allow_pickle=False): unlike a pickle, such a file cannot run code.
Dict keys keep their type (int or str), floats keep inf and nan.
"""
import json
import os

import numpy as np

_DOCUMENT = "__document__"


class DataFileError(ValueError):
    """A file is not a readable data file of the expected kind; nothing was loaded from it."""


def _encode(value, arrays):
    if isinstance(value, np.ndarray):
        name = "a%d" % len(arrays)
        arrays[name] = value
        return {"__array__": name}
    if isinstance(value, dict):
        return {"__dict__": [[_encode(k, arrays), _encode(v, arrays)] for k, v in value.items()]}
    if isinstance(value, (list, tuple)):
        return {"__list__": [_encode(v, arrays) for v in value]}
    if isinstance(value, (bool, str)) or value is None:
        return value
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        f = float(value)
        return f if np.isfinite(f) else {"__float__": repr(f)}
    raise TypeError("cannot store %s in a data file" % type(value).__name__)


def _decode(value, archive):
    if isinstance(value, dict):
        if "__array__" in value:
            return archive[value["__array__"]]
        if "__dict__" in value:
            return {_decode(k, archive): _decode(v, archive) for k, v in value["__dict__"]}
        if "__list__" in value:
            return [_decode(v, archive) for v in value["__list__"]]
        if "__float__" in value:
            return float(value["__float__"])
    return value


def write(path, tree):
    """Write `tree` to `path` atomically: a temporary file, fsync, then rename, so a reader
    never sees a torn file."""
    arrays = {}
    document = json.dumps(_encode(tree, arrays))
    arrays[_DOCUMENT] = np.frombuffer(document.encode("utf-8"), dtype=np.uint8)
    tmp = "%s.tmp%d" % (path, os.getpid())
    with open(tmp, "wb") as f:
        np.savez(f, **arrays)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    directory = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def read(path):
    """The tree written by write(); DataFileError when the file is not one (truncated,
    another format, or a pickle)."""
    try:
        with np.load(path, allow_pickle=False) as archive:
            members = {name: archive[name] for name in archive.files}
    except FileNotFoundError:
        raise
    except Exception as exc:  # zipfile, ValueError (pickle refused), OSError
        raise DataFileError("%s is not a readable slimgc data file (%s: %s)"
                            % (path, type(exc).__name__, exc)) from None
    if _DOCUMENT not in members:
        raise DataFileError("%s is a NumPy archive but not a slimgc data file" % path)
    try:
        document = json.loads(bytes(members.pop(_DOCUMENT)).decode("utf-8"))
        return _decode(document, members)
    except (ValueError, KeyError) as exc:
        raise DataFileError("%s: its document is damaged (%s)" % (path, exc)) from None
