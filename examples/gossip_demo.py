"""Gossip demo: every rank starts from its own random vector; PushSum over the exponential graph
drives all of them to the network average. Prints the consensus error per step.

    mpirun -np 4 python examples/gossip_demo.py
"""
import argparse

import numpy as np

from hvd_sgp.common import PushSumMixer, allocate, init, make_topology, rank, size
from hvd_sgp.common.runtime import world_comm
from hvd_sgp.common.transport import PeerTransport
from hvd_sgp.common.telemetry import consensus


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--topology", default="exponential")
    parser.add_argument("--peers", type=int, default=1)
    parser.add_argument("--length", type=int, default=1_000_000)
    args = parser.parse_args()
    init()
    buffer = allocate(args.length, np.float64)
    buffer[:-1] = np.random.default_rng(rank()).normal(size=args.length)
    mixer = PushSumMixer(buffer, make_topology(args.topology, size(), args.peers),
                         PeerTransport(world_comm()))
    for step in range(args.steps + 1):
        c = consensus(buffer[:-1], world_comm())
        if rank() == 0:
            print(f"step {step:3d}  consensus distance {c['distance']:.3e}  "
                  f"rank 0 deviation {c['deviation']:.3e}", flush=True)
        mixer.mix()


if __name__ == "__main__":
    main()
