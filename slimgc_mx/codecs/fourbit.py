"""4bit (Jiang et al. 2021): 7 thresholds per group, compress toward zero, error feedback.

r += g; for r > 0 emit the largest threshold X_k <= r (X7 when r >= X7) and subtract it;
symmetric for r < 0; |r| < X1 emits 0. The wire carries the signed value in the group's
unit u (a divisor of its thresholds, in 0.01s): q = v / u + X7 / u, L = 2 * X7 / u + 1
(121 levels for group 1, 19 for groups 2 and 3).
The threshold group is shared: each worker appends a trailer lane with its mean |g|;
decode() picks the NEXT push's group from (trailer sum) / N. The first push uses group 3.
Every worker so knows the push's geometry before encoding: one wire round per geometry
is declared, and push_rounds() picks the group's.
"""
import numpy as np

from .base import Traits, kernels
from .lanes import LaneCodec, LaneReference, lane_geometry
from .registry import register

#: Table 1 thresholds X1..X7 of each group, in units of 0.01.
GROUPS = {
    1: (4, 7, 10, 20, 30, 40, 60),
    2: (10, 30, 50, 60, 70, 80, 90),
    3: (1, 3, 5, 6, 7, 8, 9),
}
UNIT = 0.01
#: Each group's wire unit, in units of 0.01: it divides every threshold of the group.
GROUP_UNITS = {1: 1, 2: 10, 3: 1}
INITIAL_GROUP = 3


def group_offset(group):
    """Level offset of `group`: its largest threshold in its own unit."""
    return GROUPS[group][-1] // GROUP_UNITS[group]


def group_levels(group):
    """L of `group`: the signed values -X7..X7 in its unit."""
    return 2 * group_offset(group) + 1


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


# Kernel arguments per group: thresholds, units with a leading 0 (below X1), unit, offset.
_KERNEL_ARGS = {g: (group_thresholds(g), np.array((0,) + u, dtype=np.intc), GROUP_UNITS[g],
                    group_offset(g)) for g, u in GROUPS.items()}
#: The lane geometries' level counts, in order of first use (the initial group's first).
_GEOMETRY_LEVELS = tuple(dict.fromkeys(
    group_levels(g) for g in (INITIAL_GROUP,) + tuple(sorted(GROUPS))))


@register
class FourBit(LaneCodec):
    """Paper-exact 4bit with per-key threshold groups agreed through decode().

    `threshold` is accepted for a uniform create() call and ignored: Table 1 decides.
    """

    name = "4bit"
    trailer_lanes = 1
    TRAITS = Traits(fuses_local_update=True)

    def __init__(self, threshold=None, num_threads=None):
        super().__init__(threshold=threshold, num_threads=num_threads)
        self.group = INITIAL_GROUP

    @property
    def levels(self):
        """L of the current group's wire (the next push's)."""
        return group_levels(self.group)

    def _affine(self):
        # scale stays 0.01 and the unit goes in a, so that a sum decodes from the same
        # exact integer (in 0.01s) whatever the group.
        unit = GROUP_UNITS[self.group]
        return UNIT, unit, -unit * group_offset(self.group)

    def _lanes_for(self, levels, size, num_workers):
        _, k = lane_geometry(levels, num_workers, self.name)
        return -(-int(size) // k) + self.trailer_lanes

    def wire_rounds(self, size, shape, num_workers):
        """One sum key per geometry of the groups (L = 19, L = 121), in round_levels() order."""
        rounds = []
        for levels in _GEOMETRY_LEVELS:
            n = max(1, self._lanes_for(levels, size, num_workers))
            rounds.append(("sum", (n,), (n,), self.wire_dtype))
        return rounds

    def round_levels(self):
        return _GEOMETRY_LEVELS

    def push_rounds(self, size, num_workers):
        """The key of the current group's geometry (the group is agreed state)."""
        return (_GEOMETRY_LEVELS.index(self.levels),)

    def wire_bits_per_element(self, num_workers):
        """The worst group's bits (group 1's L = 121); group_wire_bits() gives each group's."""
        return max(self.group_wire_bits(num_workers).values())

    def group_wire_bits(self, num_workers):
        """{group: bits per element on the wire, each direction} for `num_workers`."""
        return {g: 8.0 * self.wire_dtype.itemsize
                / lane_geometry(group_levels(g), num_workers, self.name)[1] for g in GROUPS}

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

    def _encode_into(self, grad, residual, out, radix, k, grad_checked=False, local=None):
        thresholds, units, unit, offset = _KERNEL_ARGS[self.group]
        return self._chunk_order_sum(self._kernel_result(
            kernels().encode_4bit(grad, residual, out, self._powers(radix, k), thresholds,
                                  units, unit, offset, self.num_threads, grad_checked,
                                  local),
            grad, residual, out))

    def device_levels(self, c, ops):
        # the count of thresholds <= |c|, as the kernel's selects take it, picks the unit
        a = ops.abs(c)
        idx = 0
        for x in group_thresholds(self.group).tolist():
            idx = idx + ops.level(a >= x)
        group, offset = self.group, group_offset(self.group)
        units = ops.table("units", group, [u // GROUP_UNITS[group] for u in (0,) + GROUPS[group]])
        u = ops.take(units, idx)
        return ops.where(c < 0.0, offset - u, u + offset)

    def device_statistic(self, grad, compensated):
        return grad


@register(reference=True)
class FourBitReference(LaneReference, FourBit):
    def _levels(self, c):
        a = np.abs(c)
        idx = np.zeros(c.shape[0], dtype=np.int64)
        for x in group_thresholds(self.group):
            idx += a >= x
        u = np.array((0,) + GROUPS[self.group], dtype=np.int64)[idx] // GROUP_UNITS[self.group]
        return group_offset(self.group) + np.where(c < 0, -u, u)

    def _statistic(self, grad, c, k):
        return np.abs(grad).astype(np.float64)
