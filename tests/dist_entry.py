"""Entry for the multi-process tests: ``torchrun ... tests/dist_entry.py '<json list of override lists>'``.

Runs each GRPO run in turn in the same process group (one interpreter start per rank for all of
them), with the toy task registered. Not a test module itself.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments.config import build_config  # noqa: E402
from experiments.rl.distributed import shutdown  # noqa: E402
from experiments.rl.trainer import GRPOTrainer  # noqa: E402
from tests.toy_task import Toy  # noqa: E402,F401  (registers the toy task)

if __name__ == "__main__":
    try:
        for overrides in json.loads(sys.argv[1]):
            GRPOTrainer(build_config(overrides)).train()
    finally:
        shutdown()
