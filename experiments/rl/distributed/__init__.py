"""Multi-process training strategies (docs/distributed.md), one module each behind one interface.

``base`` — the interface (:class:`DataParallel`, which is also ``ddp``), the registry and
:func:`build_strategy`; ``fsdp2`` — row-sharded weights; ``deepspeed`` — ZeRO.
"""

from experiments.rl.distributed.base import (STRATEGIES, DataParallel, DistConfig, build_strategy,
                                             register_strategy, shutdown, through_root, world_size)
from experiments.rl.distributed.deepspeed import DeepSpeed, DeepSpeedMethod, load_deepspeed_config
from experiments.rl.distributed.fsdp2 import FSDP2, GatheringSender

__all__ = ["STRATEGIES", "DataParallel", "DistConfig", "build_strategy", "register_strategy", "shutdown", "through_root",
           "world_size", "DeepSpeed", "DeepSpeedMethod", "load_deepspeed_config", "FSDP2", "GatheringSender"]
