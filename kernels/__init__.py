"""Data movers: copy planning (run coalescing) and the host copy engine.

The planner is shared by every backend; the CUDA kernels and their loader
(imported only by the ``cuda`` backend) also live here.
"""

from kvswap.kernels.planner import CopyPlan, plan_copy
from kvswap.kernels.host_copy import HostPlanCopier

__all__ = ["HostPlanCopier", "CopyPlan", "plan_copy"]
