"""Decode latency of the MoE comm backends on a tiny MoE model (see moe_comm/serving/latency_bench.py).

    python bench/decode_latency.py --help
"""

import os
import sys

if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout
    from moe_comm.serving.latency_bench import main

    sys.exit(main())
