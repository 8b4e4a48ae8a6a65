"""SlimGC's engine, which knows neither framework: the three strategies (cttab.py: Strategy 1,
offload.py: Strategy 2, backup.py: Strategy 3), the planner and its Plan (planner.py,
push_plan.py), grad_buf/fp_buf/bit_buf (grad_buf.py), the update rule's seam and SGD's shared
arithmetic (sgd_rule.py), clipping by a step's norm (step_clip.py), agreement and checkpoint
state, composed by aggregator.py over a transport and a framework adapter that implements
backend.py's protocol (docs/backend.md). numpy_backend.py is that protocol on plain NumPy.

Importing it imports no framework; slimgc_mx.mxnet and slimgc_mx.torch are its adapters.
"""
