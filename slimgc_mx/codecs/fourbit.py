"""4bit (Jiang et al. 2021): 7 thresholds per group, compress toward zero, error feedback.

r += g; for r > 0 emit the largest threshold X_k <= r (X7 when r >= X7) and subtract it;
symmetric for r < 0; |r| < X1 emits 0. Every threshold is a multiple of 0.01, so the
wire carries the signed value in 0.01 units, v in [-90, 90]: level q = v + 90, L = 181.
The threshold group is shared: each worker appends a trailer lane with its mean |g|;
decode() picks the NEXT push's group from (trailer sum) / N. The first push uses group 3.
"""
import numpy as np

from .base import kernels
from .lanes import LaneCodec, LaneReference
from .registry import register

#: Table 1 thresholds X1..X7 of each group, in units of 0.01.
GROUPS = {
    1: (4, 7, 10, 20, 30, 40, 60),
    2: (10, 30, 50, 60, 70, 80, 90),
    3: (1, 3, 5, 6, 7, 8, 9),
}
UNIT = 0.01
#: Largest threshold of any group, in units: the level offset.
MAX_UNITS = 90
INITIAL_GROUP = 3


def group_for_mean(mean_abs_grad):
    """Table 1: mean |g| > 0.5 -> group 2, 0.1 .. 0.5 -> group 1, < 0.1 -> group 3."""
    if mean_abs_grad > 0.5:
        return 2
    if mean_abs_grad >= 0.1:
        return 1
    return 3


def group_thresholds(group):
    """float32 thresholds X1..X7 of `group`: float32(0.01 * units), as emitted on decode."""
    return (UNIT * np.array(GROUPS[group], dtype=np.float64)).astype(np.float32)


# Kernel arguments per group: thresholds, and units with a leading 0 (below X1).
_KERNEL_ARGS = {g: (group_thresholds(g), np.array((0,) + u, dtype=np.intc))
                for g, u in GROUPS.items()}


@register
class FourBit(LaneCodec):
    """Paper-exact 4bit with per-key threshold groups agreed through decode().

    `threshold` is accepted for a uniform create() call and ignored: Table 1 decides.
    """

    name = "4bit"
    levels = 2 * MAX_UNITS + 1
    trailer_lanes = 1

    def __init__(self, threshold=None, num_threads=None):
        super().__init__(threshold=threshold, num_threads=num_threads)
        self.group = INITIAL_GROUP

    def _affine(self):
        return UNIT, 1, -MAX_UNITS

    def _agree(self, mean_stat):
        self.group = group_for_mean(mean_stat)

    def state_dict(self):
        state = super().state_dict()
        state["group"] = self.group
        return state

    def load_state_dict(self, state):
        super().load_state_dict(state)
        if state.get("group") not in GROUPS:
            raise ValueError("4bit group must be one of %s, got %r"
                             % (sorted(GROUPS), state.get("group")))
        self.group = int(state["group"])

    def _encode_into(self, grad, residual, out, radix, k, grad_checked=False):
        thresholds, units = _KERNEL_ARGS[self.group]
        return self._chunk_order_sum(self._kernel_result(
            kernels().encode_4bit(grad, residual, out, self._powers(radix, k), thresholds,
                                  units, MAX_UNITS, self.num_threads, grad_checked),
            grad, residual, out))

    def device_levels(self, c, nd, const):
        a = nd.abs(c)
        idx = None
        for x in group_thresholds(self.group).tolist():
            step = a >= x
            idx = step if idx is None else idx + step
        units = const("units", self.group,
                      lambda: nd.array((0,) + GROUPS[self.group], ctx=c.context,
                                       dtype=np.float32))
        u = nd.take(units, idx)
        return nd.where(c < 0.0, MAX_UNITS - u, u + MAX_UNITS)

    def device_statistic(self, grad, compensated):
        return grad


@register(reference=True)
class FourBitReference(LaneReference, FourBit):
    def _levels(self, c):
        a = np.abs(c)
        idx = np.zeros(c.shape[0], dtype=np.int64)
        for x in group_thresholds(self.group):
            idx += a >= x
        u = np.array((0,) + GROUPS[self.group], dtype=np.int64)[idx]
        return MAX_UNITS + np.where(c < 0, -u, u)

    def _statistic(self, grad, c, k):
        return np.abs(grad).astype(np.float64)
