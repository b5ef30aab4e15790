"""Channel throughput and per-item overhead, worker -> worker on one node, beside raw ray.put/ray.get of the same
payload between the same two actors in the same run. Prints a table; asserts nothing.

    python benchmarks/channel.py [--reps 7]
"""

import argparse
import os
import statistics
import time
import warnings

import ray
import torch

from m2flow.runtime.channel import Channel

# label, bytes per item, items per rep, items per put_many / get_batch
SIZES = [("1 KB", 1 << 10, 400, 1), ("1 MB", 1 << 20, 100, 1), ("64 MB", 64 << 20, 8, 1),
         ("1 KB", 1 << 10, 400, 20), ("1 MB", 1 << 20, 100, 20)]


@ray.remote(num_cpus=0)
class Producer:
    def make(self, nbytes):
        self.tensor = torch.randn(nbytes // 4)
        self.array = self.tensor.numpy()

    def channel_put(self, ch, n, batch=1):
        for _ in range(0, n, batch):
            ch.put_many([self.tensor] * batch)

    def raw_put(self, n, as_numpy):
        value = self.array if as_numpy else self.tensor
        return [[ray.put(value)] for _ in range(n)]  # wrapped, so the refs reach the consumer unresolved

    def put_small(self, ch, n, batch):
        items = [{"step": i, "reward": 0.5, "text": "a small python object"} for i in range(n)]
        if batch == 1:
            for it in items:
                ch.put(it)
        else:
            for i in range(0, n, batch):
                ch.put_many(items[i:i + batch])

    def ping(self):
        return None


@ray.remote(num_cpus=0)
class Consumer:
    def channel_get(self, ch, n, batch=1):
        for _ in range(0, n, batch):
            t = ch.get_batch(batch)[-1]
        return t.shape[0]

    def raw_get(self, boxes, as_numpy):
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        for box in boxes:
            v = ray.get(box[0])
            t = torch.from_numpy(v) if as_numpy else v  # read-only shared memory, as the channel gives
        return t.shape[0]

    def get_small(self, ch, n, batch):
        got = 0
        while got < n:
            got += 1 if batch == 1 else len(ch.get_batch(batch))
        return got

    def ping(self, other):
        t0 = time.perf_counter()
        for _ in range(200):
            ray.get(other.ping.remote())
        return (time.perf_counter() - t0) / 200


def median_times(fns: dict, reps: int) -> dict:
    """Median seconds of each fn; the fns take turns within each rep (so they meet the same machine state),
    after one warm-up turn (processes started, object-store pages touched)."""
    times = {name: [] for name in fns}
    for rep in range(reps + 1):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            if rep:
                times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    if not ray.is_initialized():
        ray.init(include_dashboard=False, logging_level="ERROR")
    prod, cons = Producer.remote(), Consumer.remote()
    ch = Channel.create("bench-channel")
    ray.get([prod.make.remote(1), cons.get_small.remote(ch, 0, 1)])  # start both, pass the channel once
    print(f"# {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}, ray {ray.__version__}, "
          f"torch {torch.__version__}, median of {args.reps} reps after a warm-up, methods taking turns")
    print("# every row: the producer actor puts N items, then the consumer actor gets them (same node)")
    print(f"{'payload':>8} {'N':>4} {'batch':>5} | {'channel MB/s':>12} | {'raw torch MB/s':>14} {'ratio':>6} | "
          f"{'raw numpy MB/s':>14} {'ratio':>6}")
    for label, nbytes, n, batch in SIZES:
        ray.get(prod.make.remote(nbytes))

        def via_channel():
            ray.get(prod.channel_put.remote(ch, n, batch))
            ray.get(cons.channel_get.remote(ch, n, batch))

        def raw(as_numpy):
            ray.get(cons.raw_get.remote(ray.get(prod.raw_put.remote(n, as_numpy)), as_numpy))

        t = median_times({"channel": via_channel, "torch": lambda: raw(False), "numpy": lambda: raw(True)}, args.reps)
        rates = [n * nbytes / 1e6 / t[k] for k in ("channel", "torch", "numpy")]
        print(f"{label:>8} {n:>4} {batch:>5} | {rates[0]:>12.1f} | {rates[1]:>14.1f} {rates[0] / rates[1]:>6.2f} | "
              f"{rates[2]:>14.1f} {rates[0] / rates[2]:>6.2f}")

    n = 400
    rtt = ray.get(cons.ping.remote(prod))
    print(f"\nsmall python objects, worker -> worker, producer and consumer running together, {n} items "
          f"(one Ray actor call round trip: {rtt * 1e3:.2f} ms)")
    for batch in (1, 32):
        def stream():
            ray.get([prod.put_small.remote(ch, n, batch), cons.get_small.remote(ch, n, batch)])

        t = median_times({"stream": stream}, args.reps)["stream"]
        how = "put / get" if batch == 1 else f"put_many / get_batch of {batch}"
        print(f"  {how:<30} {n / t:>8.0f} items/s   {t / n * 1e3:>6.3f} ms per item")

    local = Channel.create("bench-local")  # never leaves the driver: by reference
    item = {"step": 0}

    def same_process():
        for _ in range(n):
            local.put(item)
            local.get()

    t = median_times({"local": same_process}, args.reps)["local"]
    print(f"  {'same process (by reference)':<30} {n / t:>8.0f} items/s   {t / n * 1e3:>6.3f} ms per item (put + get)")
    local.destroy()
    ch.destroy()


if __name__ == "__main__":
    main()
