"""Gradient codecs whose compressed lanes a stock MXNet server can sum exactly.

    c = create("2bit", threshold=0.5)
    lanes = c.encode(grad, residual, num_workers)        # residual updated in place
    total = c.decode(lanes_sum, size, num_workers)       # sum over workers, float32

One file per codec; each registers itself (docs/codecs.md, docs/extending.md). Nothing
here imports MXNet.
"""
from . import (dgc, fourbit, gcomp, none, onebit, powersgd, qsgd, randomk,  # noqa: F401
               terngrad, thc, topk, twobit)  # (each registers its codec)
from .base import Codec, NonFiniteGradientError, OptimizerView, Traits
from .feedback import ErrorFeedback
from .lanes import LaneCodec, lane_geometry
from .registry import available, create, option_names, register

__all__ = ["Codec", "ErrorFeedback", "LaneCodec", "NonFiniteGradientError", "OptimizerView",
           "Traits", "available", "create", "lane_geometry", "option_names", "register"]
