"""Resident memory of a server under a flood of distinct grammars (the figure docs/agents.md's structured
outputs section states): serve the demo model on CPU, then print the resident MiB of the server and
of each process under it (forkserver, compile workers) idle, after each of FLOODS floods of N
distinct schemas (every third a 3,000-string enum, the rest 60-field objects) from 16 clients at
once, with the statuses they got, and after a minute idle.

    python scripts/grammar_flood_rss.py            # N=150 FLOODS=6 by default
"""
from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

PORT = 8211
N, FLOODS = int(os.environ.get("N", "150")), int(os.environ.get("FLOODS", "6"))


def resident_mib(pid: int) -> tuple[int, list[int]]:
    """The resident MiB of ``pid`` and every process under it: (the sum, each one)."""
    each, todo = [], [pid]
    while todo:
        p = todo.pop()
        todo += map(int, subprocess.run(["pgrep", "-P", str(p)], capture_output=True, text=True).stdout.split())
        status = Path(f"/proc/{p}/status")
        rss = [line.split()[1] for line in status.read_text().splitlines() if line.startswith("VmRSS:")] \
            if status.exists() else []
        each += [int(rss[0]) // 1024] if rss else []
    return sum(each), each


def post(body: dict) -> int:
    request = urllib.request.Request(f"http://127.0.0.1:{PORT}/v1/completions", json.dumps(body).encode(),
                                     {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=300) as answer:
            return answer.status
    except urllib.error.HTTPError as e:
        return e.code


def schema(i: int) -> dict:
    if i % 3 == 0:
        return {"enum": [f"e{i}-{j}" for j in range(3000)]}
    props = {f"field_{i}_{k}": {"type": "string", "enum": [f"v{i}_{k}_{j}" for j in range(20)]} for k in range(60)}
    return {"type": "object", "properties": props, "required": list(props)}


def constrained(i: int) -> int:
    return post({"model": "demo", "prompt": "x", "max_tokens": 2, "structured_outputs": {"json": schema(i)}})


def main() -> None:
    server = subprocess.Popen([sys.executable, "-m", "engine", "serve", "--port", str(PORT), "--served-model-name",
                               "demo"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(300):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{PORT}/health", timeout=2)
                break
            except OSError:
                time.sleep(1)
        print("idle:", resident_mib(server.pid))
        for flood in range(FLOODS):
            start = time.monotonic()
            with concurrent.futures.ThreadPoolExecutor(16) as pool:
                codes = Counter(pool.map(constrained, range(flood * N, (flood + 1) * N)))
            print(f"flood {flood}: {N} schemas in {time.monotonic() - start:.0f} s, statuses {dict(codes)}, "
                  f"resident MiB {resident_mib(server.pid)}")
        time.sleep(60)
        print("after a minute idle:", resident_mib(server.pid))
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()
