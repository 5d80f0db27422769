"""Load-test a running ``inference.serve`` (or any OpenAI-compatible server) on loopback.

N concurrent clients send streamed chat (or completion) requests back to back for a fixed duration, after a
warm-up; the script prints throughput, latency and time-to-first-token percentiles, errors, and the server's
resident memory (``VmRSS`` of ``/proc/<pid>/status``) before and after the measured phase.

    python -m inference.serve &                          # SmolLM2-135M-Instruct on 127.0.0.1:8000
    python scripts/load_test.py --clients 16 --duration 120 --max-tokens 64

Only loopback URLs are accepted. The server pid is ``--server-pid``, or the process listening on the URL's port
(found through ``/proc/net/tcp*``; needs permission to read its ``/proc/<pid>/fd``). Every request has a client
timeout (``--timeout``), and requests still running when the duration ends are awaited at most that long.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import httpx

PROMPTS = [
    "Explain in a few sentences why the sky is blue.",
    "Write a short poem about a lighthouse keeper.",
    "List five tips for writing clean Python code.",
    "What is the difference between a list and a tuple in Python?",
    "Summarize the plot of a heist movie you invent, in one paragraph.",
    "Give me a recipe for a simple tomato soup.",
    "Describe how a hash table works to a beginner.",
    "Translate 'good morning, how are you?' into French and Spanish.",
]


@dataclass
class Result:
    ok: bool
    latency: float
    ttft: float | None = None
    output_tokens: int = 0
    error: str | None = None


@dataclass
class Phase:
    results: list[Result] = field(default_factory=list)
    start: float = 0.0
    end: float = 0.0


def _is_loopback(host: str | None) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host or "").is_loopback
    except ValueError:
        return False


def find_listening_pid(port: int) -> int | None:
    """The pid of the process with a listening TCP socket on ``port`` (Linux /proc), or None."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            local, state, inode = parts[1], parts[3], parts[9]
            if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:  # 0A = LISTEN
                inodes.add(f"socket:[{inode}]")
    if not inodes:
        return None
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            for fd in (entry / "fd").iterdir():
                if os.readlink(fd) in inodes:
                    return int(entry.name)
        except OSError:
            continue
    return None


def rss_mib(pid: int | None) -> float | None:
    """Resident memory of ``pid`` in MiB (VmRSS), or None."""
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile ``q`` in [0, 100] (None for no values)."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


async def one_request(client: httpx.AsyncClient, args, model: str, index: int) -> Result:
    prompt = PROMPTS[index % len(PROMPTS)]
    body = {"model": model, "max_tokens": args.max_tokens, "temperature": args.temperature, "stream": True,
            "stream_options": {"include_usage": True}}
    if args.ignore_eos:
        body["ignore_eos"] = True
    if args.endpoint == "chat":
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": prompt}]
    else:
        path, body["prompt"] = "/v1/completions", prompt
    start = time.perf_counter()
    ttft, tokens = None, 0
    try:
        async with client.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                await response.aread()
                return Result(False, time.perf_counter() - start, error=f"HTTP {response.status_code}")
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                payload = line[6:]
                if payload == "[DONE]":
                    break
                event = json.loads(payload)
                if "error" in event:
                    return Result(False, time.perf_counter() - start, error=f"stream error: "
                                  f"{event['error'].get('code')}")
                for choice in event.get("choices", []):
                    text = choice.get("text") or (choice.get("delta") or {}).get("content")
                    if text and ttft is None:
                        ttft = time.perf_counter() - start
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
    except httpx.TimeoutException:
        return Result(False, time.perf_counter() - start, error="timeout")
    except (httpx.HTTPError, json.JSONDecodeError) as err:
        return Result(False, time.perf_counter() - start, error=type(err).__name__)
    return Result(True, time.perf_counter() - start, ttft, tokens)


async def run_phase(client: httpx.AsyncClient, args, model: str, seconds: float, counter: list[int]) -> Phase:
    phase = Phase(start=time.perf_counter())
    deadline = phase.start + seconds

    async def worker(worker_id: int) -> None:
        while time.perf_counter() < deadline:
            if args.max_requests and counter[0] >= args.max_requests:
                return
            counter[0] += 1
            phase.results.append(await one_request(client, args, model, worker_id + counter[0]))

    await asyncio.wait_for(asyncio.gather(*(worker(i) for i in range(args.clients))),
                           timeout=seconds + args.timeout + 30)
    phase.end = time.perf_counter()
    return phase


def summarize(phase: Phase, rss_before: float | None, rss_after: float | None, rss_peak: float | None,
              args) -> dict:
    ok = [r for r in phase.results if r.ok]
    errors: dict[str, int] = {}
    for r in phase.results:
        if not r.ok:
            errors[r.error] = errors.get(r.error, 0) + 1
    elapsed = phase.end - phase.start
    tokens = sum(r.output_tokens for r in ok)
    lat = [r.latency for r in ok]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.ttft is not None and r.output_tokens > 1]

    def ms(v):
        return None if v is None else round(1000 * v, 1)

    growth = None if rss_before is None or rss_after is None else round(100 * (rss_after / rss_before - 1), 2)
    return {
        "clients": args.clients, "duration_s": args.duration, "endpoint": args.endpoint,
        "elapsed_s": round(elapsed, 1),  # the duration plus the tail: requests started before it ended finish
        "max_tokens": args.max_tokens, "requests": len(phase.results), "completed": len(ok),
        "errors": sum(errors.values()), "errors_by_kind": errors,
        "requests_per_s": round(len(ok) / elapsed, 3), "output_tokens_per_s": round(tokens / elapsed, 2),  # /elapsed
        "mean_output_tokens": round(tokens / len(ok), 1) if ok else None,
        "latency_ms": {"p50": ms(percentile(lat, 50)), "p90": ms(percentile(lat, 90)), "p99": ms(percentile(lat, 99)),
                       "max": ms(max(lat) if lat else None)},
        "ttft_ms": {"p50": ms(percentile(ttft, 50)), "p99": ms(percentile(ttft, 99)),
                    "mean": ms(statistics.fmean(ttft) if ttft else None)},
        "tpot_ms_mean": ms(statistics.fmean(tpot) if tpot else None),
        "server_rss_mib": {"before": rss_before and round(rss_before, 1), "after": rss_after and round(rss_after, 1),
                           "peak": rss_peak and round(rss_peak, 1), "growth_percent": growth},
    }


async def main_async(args) -> dict:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.clients + 4, max_keepalive_connections=args.clients + 4)
    async with httpx.AsyncClient(base_url=args.url, headers=headers, timeout=args.timeout, limits=limits,
                                 trust_env=False) as client:
        model = args.model
        if model is None:
            response = await client.get("/v1/models")
            response.raise_for_status()
            model = response.json()["data"][0]["id"]
        pid = args.server_pid or find_listening_pid(urlparse(args.url).port or 80)
        counter = [0]
        if args.warmup > 0:
            print(f"warm-up: {args.clients} clients for {args.warmup:g} s ...", file=sys.stderr)
            await run_phase(client, args, model, args.warmup, counter)
        rss_before = rss_mib(pid)
        peak = [rss_before or 0.0]

        async def sample_rss():
            while True:
                value = rss_mib(pid)
                if value is not None:
                    peak[0] = max(peak[0], value)
                await asyncio.sleep(1.0)

        sampler = asyncio.create_task(sample_rss())
        print(f"measuring: {args.clients} clients for {args.duration:g} s against {args.url} ({model}), "
              f"server pid {pid}", file=sys.stderr)
        counter[0] = 0
        try:
            phase = await run_phase(client, args, model, args.duration, counter)
        finally:
            sampler.cancel()
        rss_after = rss_mib(pid)
        summary = summarize(phase, rss_before, rss_after, peak[0] if pid else None, args)
        summary.update(model=model, server_pid=pid)
        return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (loopback only)")
    parser.add_argument("--clients", type=int, default=16, help="concurrent clients (1..256)")
    parser.add_argument("--duration", type=float, default=120.0, help="measured seconds (<= 3600)")
    parser.add_argument("--warmup", type=float, default=10.0, help="seconds of load before measuring (RSS baseline)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--ignore-eos", action="store_true", help="always generate max_tokens (vLLM extension)")
    parser.add_argument("--endpoint", choices=["chat", "completions"], default="chat")
    parser.add_argument("--timeout", type=float, default=120.0, help="client timeout per request, seconds")
    parser.add_argument("--max-requests", type=int, default=0, help="stop after this many requests (0: no cap)")
    parser.add_argument("--model", default=None, help="model name (default: the first of /v1/models)")
    parser.add_argument("--api-key", default=os.environ.get("SSD_EAGLE_API_KEY"))
    parser.add_argument("--server-pid", type=int, default=None, help="pid whose RSS to report (default: by port)")
    parser.add_argument("--json", default=None, help="also write the summary to this file")
    args = parser.parse_args(argv)
    if not _is_loopback(urlparse(args.url).hostname):
        parser.error("--url must be a loopback address (127.0.0.1, ::1 or localhost)")
    if not 1 <= args.clients <= 256 or not 0 < args.duration <= 3600 or args.max_tokens < 1:
        parser.error("need 1 <= --clients <= 256, 0 < --duration <= 3600 and --max-tokens >= 1")
    summary = asyncio.run(main_async(args))
    print(json.dumps(summary, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
    return 0 if summary["errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
