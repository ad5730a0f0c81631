"""Process groups and devices: see :mod:`rlhf_mcore.parallel.dist`; CPU support in ``cpu_compat``."""
from rlhf_mcore.parallel.dist import (
                                      ParallelDims,
                                      ParallelState,
                                      collective_device,
                                      destroy_distributed,
                                      init_distributed,
                                      pick_device,
                                      seed_everything,
)

__all__ = ["ParallelDims", "ParallelState", "collective_device", "init_distributed", "destroy_distributed",
           "pick_device", "seed_everything"]
