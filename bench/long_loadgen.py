"""The peers' side-by-side load generator (`../shared/peers/loadgen.py`) with one more workload, `long`: prompts of
about 2-3k tokens (1,600-2,400 words of its vocabulary), 256 tokens out. Same protocol, fields and JSON line.

Run as a script with the peer's python (stdlib and httpx only): `long_loadgen.py PEER_LOADGEN --workload long ...`.
"""

import asyncio
import importlib.util
import random
import sys

LONG_WORDS = (1600, 2400)
LONG_OUT = 256


def main() -> None:
    path, sys.argv = sys.argv[1], [sys.argv[0], *sys.argv[2:]]
    spec = importlib.util.spec_from_file_location("peer_loadgen", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot load {path}")
    peer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peer)
    shared = peer.workload

    def workload(name: str, n: int, seed: int) -> list:
        if name != "long":
            return shared(name, n, seed)
        rng = random.Random(seed)
        return [(peer.text(rng, rng.randint(*LONG_WORDS)), LONG_OUT) for _ in range(n)]

    peer.workload = workload
    asyncio.run(peer.main())


if __name__ == "__main__":
    main()
