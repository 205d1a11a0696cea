"""Requests/s and the client's peak memory of the `openai` backend at 8, 64 and 256 requests in
flight, against a real llama-server (our build, the tiny GGUF) on loopback.

Each level runs in a fresh interpreter (so ru_maxrss is that level's own peak): the backend is
created against the server, then `rounds` groups of N requests go through OpenAIBackend.generate —
the path a `check --concurrency N` takes, /slots sampling included. Reported: requests/s, the
process's peak RSS and its growth over the baseline after the backend was built, and the peak of
Python allocations (tracemalloc) during the groups.

    .venv/bin/python benchmarks/bench_openai.py [--levels 8,64,256] [--tokens 16] [--slots 8] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

CHILD = r"""
import json, resource, sys, time, tracemalloc
from detllm.backends.base import Request
from detllm.backends.openai import OpenAIBackend, OpenAIOptions
from detllm.core.config import Decoding
from detllm.core.prompts import FILLERS

url, n, tokens, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
b = OpenAIBackend("tiny", OpenAIOptions(base_url=url, request_timeout=600))
ids = [tuple(b.tokenize(t)) for t in FILLERS]
reqs = [Request(i, ids[i % len(ids)], FILLERS[i % len(FILLERS)], f"p{i}") for i in range(n)]
dec = Decoding(max_new_tokens=tokens)
b.generate(reqs[:2], dec, seed=0, n_logprobs=5, logprobs=True)  # warm the connection path and imports
base_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
tracemalloc.start()
t0 = time.perf_counter()
done = 0
for r in range(rounds):
    gens = b.generate(reqs, dec, seed=r, n_logprobs=5, logprobs=True)
    done += len(gens)
    busy = gens[0].evidence["server_batch"].get("server_busy_max")
wall = time.perf_counter() - t0
_, peak_py = tracemalloc.get_traced_memory()
peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"in_flight": n, "requests": done, "seconds": round(wall, 3), "requests_per_s": round(done / wall, 1),
                  "peak_rss_mib": round(peak_kb / 1024, 1), "rss_growth_mib": round((peak_kb - base_kb) / 1024, 1),
                  "peak_python_alloc_mib": round(peak_py / 2**20, 2), "server_busy_max": busy}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--levels", default="8,64,256")
    ap.add_argument("--tokens", type=int, default=16, help="max_new_tokens per request")
    ap.add_argument("--slots", type=int, default=8, help="llama-server -np")
    ap.add_argument("--rounds", type=int, default=3, help="groups of N requests per level")
    ap.add_argument("--threads", type=int, default=2, help="llama-server -t")
    args = ap.parse_args()

    from detllm.backends.llamacpp import Server, find_server, free_port
    from detllm.models import builtin_path

    port = free_port()
    srv = Server([str(find_server()), "-m", str(builtin_path("tiny", "gguf") / "model.gguf"), "--host", "127.0.0.1",
                  "--port", str(port), "-np", str(args.slots), "-c", str(args.slots * 512), "--alias", "tiny", "--no-webui",
                  "-t", str(args.threads)], port, 600.0)
    try:
        srv.wait_ready(120.0)
        url = f"http://127.0.0.1:{port}/v1"
        print(f"llama-server tiny, -np {args.slots}, -t {args.threads}; {args.tokens} new tokens, top-5 logprobs per request")
        print(f"{'in flight':>9} {'requests':>8} {'req/s':>7} {'peak RSS MiB':>12} {'RSS growth MiB':>14} {'py alloc peak MiB':>17} {'server busy max':>15}")
        for n in (int(x) for x in args.levels.split(",")):
            t0 = time.perf_counter()
            out = subprocess.run([sys.executable, "-c", CHILD, url, str(n), str(args.tokens), str(args.rounds)],
                                 capture_output=True, text=True, timeout=1800)
            if out.returncode != 0:
                raise SystemExit(f"level {n} failed: {out.stderr.strip().splitlines()[-1:]}")
            r = json.loads(out.stdout.strip().splitlines()[-1])
            print(f"{r['in_flight']:>9} {r['requests']:>8} {r['requests_per_s']:>7} {r['peak_rss_mib']:>12} {r['rss_growth_mib']:>14} "
                  f"{r['peak_python_alloc_mib']:>17} {str(r['server_busy_max']):>15}   ({time.perf_counter() - t0:.1f} s)")
    finally:
        srv.stop()


if __name__ == "__main__":
    main()
