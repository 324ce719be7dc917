"""What Flower's transport of a client's ``context.state`` costs, by the size of the state.

In a deployment a fresh ClientApp process serves each message, and Flower moves the node's
Context to and from it as protobuf (``context_to_proto`` then ``SerializeToString`` on the way
out). fedcomp keeps a client's replica and residual there (8 bytes a parameter), so this is a
per-message cost that grows with the model. This script times those two calls, and the way back
(``FromString`` then ``context_from_proto``), on a state of two float32 arrays of ``MB`` megabytes
in all, and prints the process's peak RSS (one state per process: the peak is this state's)::

    python scripts/state_transport.py 128 512 1024

Each size runs in its own child process.
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import time


def _peak_mib() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024


def measure(mb: int) -> str:
    """One line: the state's size, the time out and back, and the peak RSS."""
    import numpy as np
    from flwr.app import Array, ArrayRecord, Context, RecordDict
    from flwr.common.serde import context_from_proto, context_to_proto
    from flwr.proto.message_pb2 import Context as ProtoContext

    n = mb * 2**20 // 4 // 2
    arrays = {"replica": Array(np.ones(n, dtype=np.float32)), "residual": Array(np.ones(n, dtype=np.float32))}
    context = Context(run_id=1, node_id=1, node_config={}, state=RecordDict({"s": ArrayRecord(arrays)}), run_config={})
    before = _peak_mib()
    t0 = time.perf_counter()
    data = context_to_proto(context).SerializeToString()
    out_s = time.perf_counter() - t0
    del context, arrays
    t0 = time.perf_counter()
    context_from_proto(ProtoContext.FromString(data))
    in_s = time.perf_counter() - t0
    return f"state {mb} MB: out {out_s:.2f} s, back {in_s:.2f} s, peak RSS {_peak_mib()} MiB ({before} MiB before)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mb", type=int, nargs="+", help="state sizes, MB")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # (the child's mode)
    args = parser.parse_args(argv)
    if args.one:
        print(measure(args.mb[0]), flush=True)
        return 0
    failed = 0
    for mb in args.mb:
        done = subprocess.run([sys.executable, __file__, "--one", str(mb)], check=False)
        if done.returncode:
            print(f"state {mb} MB: the child exited {done.returncode} (-9: killed, e.g. for memory)", flush=True)
            failed = 1
    return failed


if __name__ == "__main__":
    raise SystemExit(main())
