"""Train an SB3 off-policy agent with HER on a disk-backed store; run it again to resume: ``her-store train``.

    python tools/train.py                                   # DQN+HER on SB3's BitFlippingEnv, a few minutes
    python tools/train.py --env her_store/PointGoal-v0 --algo sac --steps 20000 --out runs/point
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from her_store.cli.main import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
