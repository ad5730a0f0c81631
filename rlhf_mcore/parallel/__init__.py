"""Process groups and devices: see :mod:`rlhf_mcore.parallel.dist`; CPU support in ``cpu_compat``."""
from rlhf_mcore.parallel.dist import (
                                      ParallelDims,
                                      ParallelState,
                                      destroy_distributed,
                                      init_distributed,
                                      pick_device,
                                      seed_everything,
)

__all__ = ["ParallelDims", "ParallelState", "init_distributed", "destroy_distributed", "pick_device",
           "seed_everything"]
