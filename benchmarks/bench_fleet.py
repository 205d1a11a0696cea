"""The fleet's client at scale (issue 24 item 3): printed figures, no timed asserts.

1. Client overhead: N stub endpoints (tests/stubhttp.py, in a process of their own) that answer every
   completion after a fixed sleep, no compute. `detllm check` against one endpoint with 100 requests
   in flight, then against 8 endpoints with 100 each (800 in flight): wall time side by side (the
   target is 8 x 100 within 1.2x of 1 x 100), the client's CPU time and peak RSS.
2. Memory: the client's peak RSS at 100 requests in flight (8 endpoints x 13, and 1 x 100) and at
   800 (8 x 100); the target is < 100 MB growth. Each check streams its trace to its replica folder.
3. Real servers: 8 real llama-servers (tiny GGUF, -t 1) in one fleet check; the verdict (the 8
   identical servers must agree), the client's CPU time and peak RSS. On 2 cores the servers
   compete for the CPU, so the wall time is theirs as much as the client's.

4. --profile: one in-process fleet check at 8 x --prompts with a cProfile per replica thread, timed by
   that thread's CPU clock (so GIL waits are not counted), and the CPU time of each thread.
5. --base REV: 1 x and 8 x --prompts with the client of commit REV (a temporary worktree) and of this
   tree, alternated pair by pair against the same stubs: each side's 8-vs-1 wall ratio (median and per
   pair), client CPU, the stubs' CPU at 8 x, peak RSS at 1 x and 8 x and its growth, the load average.

Each client run is a fresh `detllm check` process; its CPU time and peak RSS come from
getrusage(RUSAGE_CHILDREN) around it; the stub servers' CPU meanwhile (stub_cpu_s, "stub 8x") from
/proc, and the connections they accepted and the requests they answered (conns, requests; "conns 8x"
is connections/requests) from the stubs' own counts. They run on the client's cores: --stub asyncio serves the same answers from one asyncio thread
(a third of the CPU), to tell how much of the wall is theirs.

    .venv/bin/python benchmarks/bench_fleet.py [--sleep 2] [--prompts 100] [--runs 2] [--real 8] [--profile] [--base REV [--pairs 3]] [--stub asyncio]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DETLLM = [sys.executable, "-m", "detllm"]

STUBS = r"""
import json, sys, threading, time
sys.path.insert(0, sys.argv[1])
from http.server import ThreadingHTTPServer
from tests.stubhttp import JSONHandler, StubServer

n, sleep, tokens = int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
step = {"token": " a", "logprob": -0.5, "top_logprobs": {" a": -0.5, " b": -1.5, " c": -2.5, " d": -3.5, " e": -4.5}}
answer = json.dumps({"object": "text_completion", "model": "tiny", "choices": [{"index": 0, "text": " a" * tokens, "finish_reason": "length",
          "logprobs": {"tokens": [" a"] * tokens, "token_logprobs": [-0.5] * tokens, "top_logprobs": [step["top_logprobs"]] * tokens}}],
          "usage": {"prompt_tokens": 4, "completion_tokens": tokens}}).encode()

counts, lock = [0, 0], threading.Lock()  # connections accepted, requests answered

def count(i):
    with lock:
        counts[i] += 1

class Handler(JSONHandler):
    protocol_version = "HTTP/1.1"
    def setup(self):  # once per connection the server accepted
        count(0)
        super().setup()
    def handle_one_request(self):
        self.command = None
        super().handle_one_request()
        if self.command:
            count(1)
    def do_GET(self):
        if self.path == "/v1/models":
            return self.send_json(200, {"object": "list", "data": [{"id": "tiny", "object": "model", "owned_by": "stub"}]})
        if self.path == "/health":
            return self.send_json(200, {"status": "ok"})
        self.send_json(404, {"error": "not found"})
    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        time.sleep(sleep)
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

class Server(ThreadingHTTPServer):
    request_queue_size = 2048  # 800 connections arrive at once
    daemon_threads = True
    def handle_error(self, *a):
        pass

stubs = []
for _ in range(n):
    s = StubServer()
    s.serve(Handler, Server)
    stubs.append(s)
print(json.dumps([s.url for s in stubs]), flush=True)
for _ in sys.stdin:  # each line asks for the counts so far; until the benchmark closes our stdin
    with lock:
        print(json.dumps(counts), flush=True)
"""

# --stub asyncio: the same answers from one asyncio thread per process instead of a thread per
# connection, to tell how much of the 8 x wall is the stub servers' (they share the client's cores)
ASYNC_STUBS = r"""
import asyncio, json, sys
n, sleep, tokens = int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
top = {" a": -0.5, " b": -1.5, " c": -2.5, " d": -3.5, " e": -4.5}
answer = json.dumps({"object": "text_completion", "model": "tiny", "choices": [{"index": 0, "text": " a" * tokens, "finish_reason": "length",
          "logprobs": {"tokens": [" a"] * tokens, "token_logprobs": [-0.5] * tokens, "top_logprobs": [top] * tokens}}],
          "usage": {"prompt_tokens": 4, "completion_tokens": tokens}}).encode()
def reply(status, body):
    return b"HTTP/1.1 %d X\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (status, len(body), body)
MODELS = reply(200, json.dumps({"object": "list", "data": [{"id": "tiny", "object": "model", "owned_by": "stub"}]}).encode())
counts = [0, 0]  # connections accepted, requests answered (one thread: plain ints)
async def handle(r, w):
    counts[0] += 1
    try:
        while True:
            head = (await r.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
            method, path = head[0].split(" ")[:2]
            length = next((int(h.split(":", 1)[1]) for h in head[1:] if h.lower().startswith("content-length:")), 0)
            if length:
                await r.readexactly(length)
            if method == "POST":
                await asyncio.sleep(sleep)
                w.write(reply(200, answer))
            else:
                w.write(MODELS if path == "/v1/models" else reply(200, b'{"status":"ok"}') if path == "/health" else reply(404, b"{}"))
            counts[1] += 1
            await w.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        w.close()
async def main():
    servers = [await asyncio.start_server(handle, "127.0.0.1", 0, backlog=2048) for _ in range(n)]
    print(json.dumps([f"http://127.0.0.1:{s.sockets[0].getsockname()[1]}/v1" for s in servers]), flush=True)
    while await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline):  # a line: the counts so far
        print(json.dumps(counts), flush=True)
asyncio.run(main())
"""


def start_stubs(args) -> subprocess.Popen:
    """8 stub endpoints in a process of their own (--stub threads: the target's; asyncio: a lighter server)."""
    code = ASYNC_STUBS if args.stub == "asyncio" else STUBS
    return subprocess.Popen([sys.executable, "-c", code, str(REPO), "8", str(args.sleep), "16"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, cwd=REPO)


def client(urls: list[str], prompts: Path, in_flight: int, runs: int, out: Path, extra: list[str] | None = None,
           tree: Path = REPO) -> dict:
    """One `detllm check` process (detllm from `tree`) against `urls`; its wall time, CPU time, peak RSS and verdict."""
    args = DETLLM + ["check", "-b", "openai", "-m", "tiny", "--tier", "2", "--runs", str(runs), "--batch-size", str(in_flight),
                     "--max-new-tokens", "16", "--prompts", str(prompts), "--out", str(out), "--json", "--no-progress", *(extra or [])]
    for u in urls:
        args += ["--base-url", u]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(args, capture_output=True, text=True, cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)})
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    try:
        doc = json.loads(proc.stdout)
    except ValueError:
        raise SystemExit(f"client failed (exit {proc.returncode}): {proc.stderr[-800:]}")
    return {"endpoints": len(urls), "in_flight_each": in_flight, "in_flight": in_flight * len(urls), "exit": proc.returncode,
            "verdict": f"{doc['status']} {doc['category']}", "wall_s": round(wall, 2),
            "cpu_s": round(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, 2),
            "peak_rss_mib": round(after.ru_maxrss / 1024, 1)}  # ru_maxrss of children is the largest child's so far


def fresh_rss_client(*a, **kw) -> dict:
    """client() in a wrapper process of its own, so ru_maxrss is this run's peak and not an earlier one's."""
    code = ("import json,sys; sys.path.insert(0, %r); from benchmarks.bench_fleet import client; from pathlib import Path; "
            "a = json.loads(sys.argv[1]); print(json.dumps(client(a[0], Path(a[1]), a[2], a[3], Path(a[4]), a[5], Path(a[6]))))") % str(REPO)
    urls, prompts, in_flight, runs, out = a
    proc = subprocess.run([sys.executable, "-c", code, json.dumps([urls, str(prompts), in_flight, runs, str(out), kw.get("extra"),
                                                                   str(kw.get("tree", REPO))])],
                          capture_output=True, text=True, cwd=REPO)
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-1500:])
    return json.loads(proc.stdout)


def process_cpu(pid: int) -> float | None:
    """CPU seconds (user + system) a running process has used so far: the stub servers', which share
    the client's cores (Linux /proc; None elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def stub_counts(stubs: subprocess.Popen) -> list[int]:
    """[connections accepted, requests answered] by the stub servers so far (all 8 together)."""
    stubs.stdin.write("\n")
    stubs.stdin.flush()
    return json.loads(stubs.stdout.readline())


def with_stub_cpu(stubs: subprocess.Popen, run, *a, **kw) -> dict:
    """run(*a, **kw), with the CPU the stub process spent meanwhile as stub_cpu_s, and the connections
    the client opened to the stubs and the requests it sent them (conns, requests): a new connection
    per request, where it could have reused one, costs a thread-per-connection server a thread start."""
    before, counted = process_cpu(stubs.pid), stub_counts(stubs)
    row = run(*a, **kw)
    after, now = process_cpu(stubs.pid), stub_counts(stubs)
    row["stub_cpu_s"] = round(after - before, 2) if before is not None and after is not None else None
    row["conns"], row["requests"] = now[0] - counted[0], now[1] - counted[1]
    return row


def show(title: str, rows: list[dict]) -> None:
    print(f"\n{title}")
    keys = ["endpoints", "in_flight_each", "in_flight", "verdict", "wall_s", "cpu_s", "stub_cpu_s", "peak_rss_mib", "conns", "requests"]
    print("  " + "  ".join(f"{k:>12}" for k in keys))
    for r in rows:
        print("  " + "  ".join(f"{r.get(k)!s:>12}" for k in keys))


def stub_figures(args, tmp: Path) -> None:
    stubs = start_stubs(args)
    try:
        urls = json.loads(stubs.stdout.readline())
        prompts = tmp / "prompts.txt"
        prompts.write_text("".join(f"prompt number {i} of the fleet benchmark\n" for i in range(args.prompts)))
        runs = []
        for name, use, each in (("one", urls[:1], args.prompts), ("eight_small", urls, 13), ("eight", urls, args.prompts)):
            out = tmp / f"out_{name}"
            runs.append(with_stub_cpu(stubs, fresh_rss_client, use, prompts, each, args.runs, out))
            shutil.rmtree(out, ignore_errors=True)
        one, small, eight = runs
        show(f"1-2. stub endpoints answering after {args.sleep:g} s, {args.prompts} prompts x {args.runs} runs per endpoint, "
             "one batch = the requests in flight", runs)
        print(f"  wall time, 8 x {args.prompts} vs 1 x {args.prompts}: {eight['wall_s'] / one['wall_s']:.2f}x (target <= 1.2x)")
        print(f"  peak RSS growth from {one['in_flight']} to {eight['in_flight']} in flight: "
              f"{eight['peak_rss_mib'] - one['peak_rss_mib']:+.1f} MiB (1 endpoint) / "
              f"{eight['peak_rss_mib'] - small['peak_rss_mib']:+.1f} MiB (8 endpoints at {small['in_flight']}) (target < 100 MB)")
        print(f"  client CPU per request: {1000 * eight['cpu_s'] / (eight['in_flight'] * args.runs):.2f} ms (8 x {args.prompts}), "
              f"{1000 * one['cpu_s'] / (one['in_flight'] * args.runs):.2f} ms (1 x {args.prompts})")
    finally:
        stubs.stdin.close()
        stubs.wait(timeout=30)


def versus_base(args, tmp: Path) -> None:
    """1 x --prompts and 8 x --prompts with the client from a base commit's worktree and from this tree,
    alternated pair by pair (base first, then this tree first) against the same stub endpoints: the
    8-vs-1 wall ratio and the client CPU of each side, measured under one load."""
    base = tmp / "base"
    made = subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(base), args.base], capture_output=True, text=True)
    if made.returncode != 0:
        raise SystemExit(f"cannot check out {args.base}: {made.stderr.strip()}")
    stubs = start_stubs(args)
    try:
        urls = json.loads(stubs.stdout.readline())
        prompts = tmp / "prompts.txt"
        prompts.write_text("".join(f"prompt number {i} of the fleet benchmark\n" for i in range(args.prompts)))
        trees = {"base": base, "HEAD": REPO}
        load0 = os.getloadavg()
        got: dict[tuple[str, str], list[dict]] = {}
        for tree in trees.values():  # warm-up (bytecode compiled, page cache): not counted
            fresh_rss_client(urls[:1], prompts, args.prompts, args.runs, tmp / "warm", tree=tree)
            shutil.rmtree(tmp / "warm", ignore_errors=True)
        for i in range(args.pairs):
            for side in (("base", "HEAD") if i % 2 == 0 else ("HEAD", "base")):
                for name, use in (("1", urls[:1]), ("8", urls)):
                    out = tmp / f"vs_{side}_{name}"
                    got.setdefault((side, name), []).append(
                        with_stub_cpu(stubs, fresh_rss_client, use, prompts, args.prompts, args.runs, out, tree=trees[side]))
                    shutil.rmtree(out, ignore_errors=True)
        load1 = os.getloadavg()
    finally:
        stubs.stdin.close()
        stubs.wait(timeout=30)
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(base)], capture_output=True)
    med = statistics.median
    print(f"\n5. base {args.base} vs HEAD, {args.pairs} alternated pairs: 1 x {args.prompts} and 8 x {args.prompts} in flight, "
          f"{args.runs} runs, stub answers after {args.sleep:g} s; load average {load0[0]:.1f} before, {load1[0]:.1f} after "
          f"(1-min), on {os.cpu_count()} CPUs")
    print(f"  {'side':>6} {'wall 1x':>8} {'wall 8x':>8} {'8x/1x':>6} {'CPU 1x':>7} {'CPU 8x':>7} {'stub 8x':>7} {'RSS 1x':>7} "
          f"{'RSS 8x':>7} {'growth':>7} {'conns 8x':>12}   per-pair 8x/1x")
    for side in trees:
        one, eight = got[(side, "1")], got[(side, "8")]
        ratios = [e["wall_s"] / o["wall_s"] for o, e in zip(one, eight)]
        stub = [r["stub_cpu_s"] for r in eight if r.get("stub_cpu_s") is not None]
        rss1, rss8 = med(r['peak_rss_mib'] for r in one), med(r['peak_rss_mib'] for r in eight)
        conns = f"{med(r['conns'] for r in eight):g}/{med(r['requests'] for r in eight):g}"  # connections / requests, at 8 x
        print(f"  {side:>6} {med(r['wall_s'] for r in one):>7.2f}s {med(r['wall_s'] for r in eight):>7.2f}s {med(ratios):>5.2f}x "
              f"{med(r['cpu_s'] for r in one):>6.2f}s {med(r['cpu_s'] for r in eight):>6.2f}s "
              f"{(f'{med(stub):.2f}s' if stub else '-'):>7} {rss1:>6.1f}M {rss8:>6.1f}M {rss8 - rss1:>+6.1f}M "
              f"{conns:>12}   "
              + " ".join(f"{x:.2f}" for x in ratios))
    b8, h8 = med(r["cpu_s"] for r in got[("base", "8")]), med(r["cpu_s"] for r in got[("HEAD", "8")])
    print(f"  client CPU at 8 x {args.prompts}: HEAD/base {h8 / b8:.2f}x (medians; CPU is the figure a shared machine does not move)")


PROFILE = r"""
import cProfile, io, json, pstats, sys, threading, time
sys.path.insert(0, sys.argv[1])
import detllm
from detllm.fleet import endpoints

urls, prompts, in_flight, runs, out, PROFILED = json.loads(sys.argv[2])
profiles, cpu = [], {}
execute = endpoints.execute

def profiled(*a, **kw):  # each replica thread: its own cProfile and its own CPU time
    prof, t0 = cProfile.Profile(time.thread_time), time.thread_time()  # CPU time of this thread: no GIL waits counted
    if PROFILED:
        prof.enable()
    try:
        return execute(*a, **kw)
    finally:
        prof.disable()
        profiles.append(prof)
        cpu[threading.current_thread().name] = time.thread_time() - t0

endpoints.execute = profiled
verdict = endpoints.fleet_verdict
def timed_verdict(*a, **kw):
    t0 = time.thread_time()
    try:
        return verdict(*a, **kw)
    finally:
        cpu["verdict (main thread)"] = time.thread_time() - t0
endpoints.fleet_verdict = timed_verdict
p0, w0 = time.process_time(), time.perf_counter()
cfg = detllm.make_config(backend="openai", model="tiny", tier=2, runs=runs, batch_size=in_flight, max_new_tokens=16)
texts = open(prompts).read().splitlines()
outcome = detllm.fleet_check(cfg, urls, prompts=texts, out=out)
total, wall = time.process_time() - p0, time.perf_counter() - w0
print(f"  in-process fleet_check: {outcome.status} {outcome.category}, wall {wall:.2f} s, process CPU {total:.2f} s "
      f"(imports and interpreter start not included)")
print("  CPU by thread: " + ", ".join(f"{k} {v:.2f} s" for k, v in sorted(cpu.items())))
if not PROFILED:
    raise SystemExit(0)
stats = pstats.Stats(profiles[0])
for p in profiles[1:]:
    stats.add(p)
buf = io.StringIO()
stats.stream = buf
stats.sort_stats("tottime").print_stats(25)
print("  replica threads, all together, by own CPU time (cProfile timed by each thread's CPU clock; GIL waits not counted;")
print("  a coroutine's ncalls counts each time it resumed, not each call: wire.py's _open is listed ~3 times per connection")
print("  opened. The connections are the stubs' count, conns in sections 1-2 and 5):")
print("\n".join("    " + l for l in buf.getvalue().splitlines() if l.strip())[:6000])
buf = io.StringIO()
stats.stream = buf
stats.sort_stats("cumulative").print_stats("detllm|httpx|httpcore|anyio", 40)
print("  replica threads, detllm's functions by cumulative time:")
print("\n".join("    " + l for l in buf.getvalue().splitlines() if l.strip())[:8000])
"""


def profile_figures(args, tmp: Path) -> None:
    """Where the client's CPU goes at 8 x --prompts in flight: one in-process fleet_check with a cProfile
    per replica thread and the CPU time of each thread and of the verdict."""
    stubs = start_stubs(args)
    try:
        urls = json.loads(stubs.stdout.readline())
        prompts = tmp / "prompts_profile.txt"
        prompts.write_text("".join(f"prompt number {i} of the fleet benchmark\n" for i in range(args.prompts)))
        for profiled in (False, True):
            print(f"\n4. {'profile' if profiled else 'CPU by thread, no profiler'}: 8 stub endpoints x {args.prompts} in flight, "
                  f"{args.runs} runs, answers after {args.sleep:g} s")
            proc = subprocess.run([sys.executable, "-c", PROFILE, str(REPO), json.dumps(
                [urls, str(prompts), args.prompts, args.runs, str(tmp / f"out_profile{int(profiled)}"), profiled])],
                capture_output=True, text=True, cwd=REPO)
            print(proc.stdout.rstrip() or proc.stderr[-1500:])
    finally:
        stubs.stdin.close()
        stubs.wait(timeout=30)


def real_figures(args, tmp: Path) -> None:
    from detllm.backends.llamacpp import Server, find_server, free_port
    from detllm.models import builtin_path

    binary, gguf = find_server(), builtin_path("tiny", "gguf") / "model.gguf"
    servers = []
    try:
        for _ in range(args.real):
            port = free_port()
            srv = Server([str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-np", "4", "-c", "2048",
                          "--alias", "tiny", "--no-webui", "-t", "1"], port, 120.0)
            servers.append(srv)
            srv.wait_ready(120.0)
        urls = [f"http://127.0.0.1:{s.port}/v1" for s in servers]
        prompts = tmp / "real.txt"
        prompts.write_text("".join(f"Story {i}: once upon a time\n" for i in range(args.real_prompts)))
        rows = []
        for each in (1, 4):
            rows.append(fresh_rss_client(urls, prompts, each, 2, tmp / f"real_{each}", extra=["--opt", "cache_prompt=false"]))
        show(f"3. {args.real} real llama-servers (tiny, -t 1, -np 4) on 2 cores, {args.real_prompts} prompts x 2 runs per endpoint", rows)
        for r, each in zip(rows, (1, 4)):
            doc = json.loads((tmp / f"real_{each}" / "fleet.json").read_text())
            print(f"  {each} in flight per endpoint: {doc['status']} {doc['category']}; groups "
                  f"{[g['replicas'] for g in doc['groups']]}; own checks {sorted({(x['own_check'] or {}).get('category') for x in doc['replicas']}, key=str)}")
    finally:
        for s in servers:
            s.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sleep", type=float, default=2.0, help="seconds each stub answer waits")
    ap.add_argument("--prompts", type=int, default=100, help="prompts per endpoint = requests in flight per endpoint")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--real", type=int, default=8, help="real llama-servers (0: skip)")
    ap.add_argument("--real-prompts", type=int, default=8)
    ap.add_argument("--profile", action="store_true", help="also profile the client at 8 x --prompts in flight (cProfile per thread)")
    ap.add_argument("--base", metavar="REV", help="also run 1 x and 8 x --prompts with the client of commit REV and of this tree, "
                                                   "alternated (--pairs pairs)")
    ap.add_argument("--pairs", type=int, default=3, help="alternated base/HEAD pairs with --base")
    ap.add_argument("--stub", choices=("threads", "asyncio"), default="threads",
                    help="the stub servers: a thread per connection (the target's, default) or one asyncio thread, "
                         "to tell how much of the wall is the stubs'")
    ap.add_argument("--skip-stub", action="store_true", help="skip sections 1-2 (with --base or --profile)")
    args = ap.parse_args()
    print(f"cpus: {os.cpu_count()}, python {sys.version.split()[0]}")
    with tempfile.TemporaryDirectory(prefix="detllm-bench-fleet-") as tmp:
        if not args.skip_stub:
            stub_figures(args, Path(tmp))
        if args.base:
            versus_base(args, Path(tmp))
        if args.profile:
            profile_figures(args, Path(tmp))
        if args.real:
            real_figures(args, Path(tmp))


if __name__ == "__main__":
    main()
