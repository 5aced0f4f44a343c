"""Put objects into a Mooncake pool and hold them there until stdin closes (a test's pool client).

Runs under the stack's Python (the one with mooncake installed): a client's objects live in the memory
segment it contributes, so this process must stay up while the objects are wanted.

    python scripts/pool_put.py MASTER_RPC_ADDRESS KEY [KEY ...] < (a pipe the caller closes to end it)
"""

from __future__ import annotations

import sys

from mooncake.store import MooncakeDistributedStore


def main() -> int:
    master, keys = sys.argv[1], sys.argv[2:]
    store = MooncakeDistributedStore()
    failed = store.setup("127.0.0.1", "P2PHANDSHAKE", 64 << 20, 16 << 20, "tcp", "", master)
    if failed:
        print(f"setup failed: {failed}", file=sys.stderr)
        return 1
    for key in keys:
        code = store.put(key, b"kv" * 512)
        if code:
            print(f"put {key} failed: {code}", file=sys.stderr)
            return 1
    print("ready", flush=True)
    sys.stdin.read()
    store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
