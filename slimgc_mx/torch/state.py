"""The engine's state as torch.save keeps it with weights_only=True: tensors and plain values.

NumPy arrays travel as their bytes in a uint8 tensor with dtype and shape beside them, so
any dtype (uint64 code tables, float64 lanes) comes back bit for bit; tensors stay tensors.
"""
import numpy as np
import torch

_TAG = "__slimgc_ndarray__"


def to_tensors(value):
    """`value` with every NumPy array and scalar replaced by what torch.load reads back."""
    if isinstance(value, np.ndarray):
        data = np.ascontiguousarray(value)
        return {_TAG: torch.from_numpy(data.reshape(-1).view(np.uint8).copy()),
                "dtype": data.dtype.str, "shape": list(data.shape)}
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        return {_key(k): to_tensors(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_tensors(v) for v in value)
    return value


def from_tensors(value):
    """The inverse of to_tensors."""
    if isinstance(value, dict):
        if _TAG in value:
            raw = value[_TAG].numpy().tobytes()
            return np.frombuffer(raw, dtype=np.dtype(value["dtype"])).reshape(
                value["shape"]).copy()
        return {k: from_tensors(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(from_tensors(v) for v in value)
    return value


def _key(key):
    return key.item() if isinstance(key, np.generic) else key
