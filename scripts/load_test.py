"""Load-test a running ``inference.serve`` (or any OpenAI-compatible server) on loopback.

N concurrent clients send streamed chat (or completion) requests back to back for a fixed duration, after a
warm-up; the script prints throughput, latency and time-to-first-token percentiles, errors, the longest gap between
two chunks of a stream, and the resident memory (``VmRSS`` of ``/proc/<pid>/status``) of the server and its
speculator process (its ``spawn`` children) before and after the measured phase.

    python -m inference.serve &                          # SmolLM2-135M-Instruct on 127.0.0.1:8000
    python scripts/load_test.py --clients 16 --duration 120 --max-tokens 64
    python scripts/load_test.py --mix long-prompt --kill-speculator 10   # SSD: SIGKILL the speculator after 10 s

``--mix``: ``short`` (the chat prompts below), ``long-prompt`` (every ``1/--long-share``-th request has a unique
prompt of about ``--long-tokens`` tokens; reported: the *other* streams' longest inter-chunk gap against their
median gap), ``multi-turn`` (conversations of ``--turns`` turns over a unique ``--context-tokens`` system document,
each turn resending the earlier ones; reported: TTFT of first turns, no prefix to reuse, against later turns).
``--kill-speculator S`` SIGKILLs the speculator process S s into the measured phase; reported: errors, whether the
outputs (T = 0, short prompts) equal a reference taken one at a time before, ``/metrics`` restarts, and the
requests started after the kill that were drafted again.

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
import signal
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
WORDS = ("the river runs past old mills and quiet towns where people trade grain wool salt and stories about "
         "storms ships harvests and distant mountains").split()  # one token each, with their leading space


@dataclass
class Result:
    ok: bool
    latency: float
    ttft: float | None = None
    output_tokens: int = 0
    error: str | None = None
    kind: str = "short"  # short, long, first (turn) or later (turn)
    key: int | None = None  # the PROMPTS index of a short request
    text: str = ""
    gaps: list[float] = field(default_factory=list)  # seconds between consecutive content chunks
    drafted: int | None = None  # spec_stats.drafted_tokens of the final chunk
    started: float = 0.0  # time.perf_counter() at the request's start


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


def speculator_pids(server_pid: int | None) -> list[int]:
    """The server's ``multiprocessing`` spawn children (the SSD speculator), from ``/proc/*/stat`` and cmdline."""
    if server_pid is None:
        return []
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if not entry.name.isdigit() or int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) != server_pid:
                continue
            cmdline = (entry / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if b"spawn_main" in cmdline and b"resource_tracker" not in cmdline:
            pids.append(int(entry.name))
    return sorted(pids)


def memory(server_pid: int | None) -> dict:
    """RSS (MiB) of the server, of its speculator process(es), and their sum."""
    server, speculator = rss_mib(server_pid), sum(rss_mib(pid) or 0.0 for pid in speculator_pids(server_pid))
    return {"server": server and round(server, 1), "speculator": round(speculator, 1),
            "total": server and round(server + speculator, 1)}


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile ``q`` in [0, 100] (None for no values)."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def long_prompt(index: int, tokens: int) -> str:
    """About ``tokens`` tokens of plain words, unique from the first word (no prefix shared with another)."""
    words = [WORDS[(i * 7 + index) % len(WORDS)] for i in range(tokens)]
    return f"Document {index}. " + " ".join(words) + "\nSummarize the document above in one sentence."


async def one_request(client: httpx.AsyncClient, args, model: str, content, kind: str = "short",
                      key: int | None = None) -> Result:
    """One streamed request; ``content``: the user text, or (chat) a list of messages."""
    body = {"model": model, "max_tokens": args.max_tokens, "temperature": args.temperature, "stream": True,
            "stream_options": {"include_usage": True}}
    if args.ignore_eos:
        body["ignore_eos"] = True
    if args.endpoint == "chat":
        messages = content if isinstance(content, list) else [{"role": "user", "content": content}]
        path, body["messages"] = "/v1/chat/completions", messages
    else:
        path, body["prompt"] = "/v1/completions", content
    start = time.perf_counter()
    result = Result(False, 0.0, kind=kind, key=key, started=start)
    pieces, times = [], []  # the content chunks and their arrival times
    try:
        async with client.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                await response.aread()
                result.error = f"HTTP {response.status_code}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                payload = line[6:]
                if payload == "[DONE]":
                    break
                event = json.loads(payload)
                if "error" in event:
                    result.error = f"stream error: {event['error'].get('code')}"
                    return result
                for choice in event.get("choices", []):
                    text = choice.get("text") or (choice.get("delta") or {}).get("content")
                    if text:
                        times.append(time.perf_counter())
                        pieces.append(text)
                if event.get("usage"):
                    result.output_tokens = event["usage"]["completion_tokens"]
                if event.get("spec_stats"):
                    result.drafted = event["spec_stats"].get("drafted_tokens")
    except httpx.TimeoutException:
        result.error = "timeout"
    except (httpx.HTTPError, json.JSONDecodeError) as err:
        result.error = type(err).__name__
    finally:
        result.latency = time.perf_counter() - start
        result.ttft = times[0] - start if times else None
        result.gaps = [b - a for a, b in zip(times, times[1:])]
    result.ok, result.text = result.error is None, "".join(pieces)
    return result


async def run_phase(client: httpx.AsyncClient, args, model: str, seconds: float, counter: list[int]) -> Phase:
    phase = Phase(start=time.perf_counter())
    deadline = phase.start + seconds
    period = max(1, round(1 / args.long_share)) if args.mix == "long-prompt" else 0

    def more() -> bool:
        return time.perf_counter() < deadline and not (args.max_requests and counter[0] >= args.max_requests)

    async def conversation(worker_id: int) -> None:
        history = [{"role": "system", "content": long_prompt(counter[0] * 1000 + worker_id, args.context_tokens)}]
        for turn in range(args.turns):
            if not more():
                return
            counter[0] += 1
            history.append({"role": "user", "content": PROMPTS[(worker_id + turn) % len(PROMPTS)]})
            result = await one_request(client, args, model, list(history), "first" if turn == 0 else "later")
            phase.results.append(result)
            if not result.ok:
                return
            history.append({"role": "assistant", "content": result.text})

    async def worker(worker_id: int) -> None:
        while more():
            if args.mix == "multi-turn":
                await conversation(worker_id)
                continue
            counter[0] += 1
            index = worker_id + counter[0]
            if period and counter[0] % period == 0:
                phase.results.append(await one_request(client, args, model, long_prompt(index, args.long_tokens),
                                                       "long"))
            else:
                key = index % len(PROMPTS)
                phase.results.append(await one_request(client, args, model, PROMPTS[key], key=key))

    workers = [asyncio.ensure_future(worker(i)) for i in range(args.clients)]
    _, pending = await asyncio.wait(workers, timeout=seconds + args.timeout + 30)
    for task in pending:  # a request still running long after the duration: counted as an error
        task.cancel()
        phase.results.append(Result(False, time.perf_counter() - phase.start, error="unfinished at the phase's end"))
    phase.end = time.perf_counter()
    return phase


async def restarts_total(client: httpx.AsyncClient) -> float | None:
    """``ssd_eagle_speculator_restarts_total`` from ``/metrics`` (None: not reported)."""
    lines = (await client.get("/metrics")).text.splitlines()
    return next((float(x.split()[1]) for x in lines if x.startswith("ssd_eagle_speculator_restarts_total ")), None)


async def kill_later(seconds: float, server_pid: int | None, record: dict) -> None:
    """SIGKILL the server's speculator process ``seconds`` from now; ``record`` gets its pid and the time."""
    await asyncio.sleep(seconds)
    record.update(killed_pids=speculator_pids(server_pid), at=time.perf_counter())
    for pid in record["killed_pids"]:
        os.kill(pid, signal.SIGKILL)


async def kill_report(client: httpx.AsyncClient, args, model: str, phase: Phase, reference: dict[int, str],
                      record: dict, restarts_before: float | None) -> dict:
    """What happened around the speculator kill: errors, outputs against the reference, then (waiting up to
    ``--timeout`` s for ``/metrics`` to count the restart) whether one more request is drafted again."""
    at, short = record.get("at"), [r for r in phase.results if r.ok and r.kind == "short" and r.key in reference]
    waited = time.perf_counter()
    while (await restarts_total(client) or 0) <= (restarts_before or 0) and time.perf_counter() - waited < args.timeout:
        await asyncio.sleep(1.0)
    probe = await one_request(client, args, model, PROMPTS[0], key=0)
    return {
        "killed_pids": record.get("killed_pids", []), "killed_at_s": at and round(at - phase.start, 2),
        "errors": sum(not r.ok for r in phase.results), "outputs_compared": len(short),
        "outputs_equal_reference": sum(r.text == reference[r.key] for r in short),
        "restarts_total": {"before": restarts_before, "after": await restarts_total(client)},
        "restart_seen_after_phase_s": round(time.perf_counter() - waited, 1),
        "requests_started_after_kill_drafted": sum(bool(r.drafted) for r in phase.results if at and r.started > at),
        "next_request": {"ok": probe.ok, "drafted_tokens": probe.drafted, "equal_reference": probe.text ==
                         reference.get(0)},
    }


def _gaps(ok: list[Result]) -> dict:
    """The inter-chunk gaps of the streams other than the long prompts' (which are the ones waiting)."""
    streams = [r for r in ok if r.kind != "long" and len(r.gaps) >= 3]
    gaps = [g for r in streams for g in r.gaps]

    def ratio(r: Result) -> float:
        return max(r.gaps) / max(statistics.median(r.gaps), 1e-6)

    worst = max(streams, key=ratio, default=None)
    return {"streams": len(streams), "longest_ms": _ms(max(gaps) if gaps else None),
            "median_ms": _ms(statistics.median(gaps) if gaps else None),
            "worst_longest_over_its_median": worst and round(ratio(worst), 1)}


def _ms(v):
    return None if v is None else round(1000 * v, 1)


def summarize(phase: Phase, before: dict, after: dict, peak: float | None, args) -> dict:
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
    by_kind = {}  # first turns: no prefix to reuse; later turns: the earlier turns are a cached prefix
    for kind in sorted({r.kind for r in ok}):
        values = [r.ttft for r in ok if r.kind == kind and r.ttft is not None]
        by_kind[kind] = {"n": len(values), "p50": _ms(percentile(values, 50)), "p99": _ms(percentile(values, 99))}
    reuse = None
    if by_kind.get("first", {}).get("p50") and by_kind.get("later", {}).get("p50"):
        reuse = round(by_kind["later"]["p50"] / by_kind["first"]["p50"], 3)
    growth = None if not before["total"] or not after["total"] else round(100 * (after["total"] / before["total"]
                                                                                  - 1), 2)
    return {
        "mix": args.mix, "clients": args.clients, "duration_s": args.duration, "endpoint": args.endpoint,
        "elapsed_s": round(elapsed, 1),  # the duration plus the tail: requests started before it ended finish
        "max_tokens": args.max_tokens, "requests": len(phase.results), "completed": len(ok),
        "errors": sum(errors.values()), "errors_by_kind": errors,
        "requests_per_s": round(len(ok) / elapsed, 3), "output_tokens_per_s": round(tokens / elapsed, 2),  # /elapsed
        "mean_output_tokens": round(tokens / len(ok), 1) if ok else None,
        "latency_ms": {"p50": _ms(percentile(lat, 50)), "p90": _ms(percentile(lat, 90)),
                       "p99": _ms(percentile(lat, 99)), "max": _ms(max(lat) if lat else None)},
        "ttft_ms": {"p50": _ms(percentile(ttft, 50)), "p99": _ms(percentile(ttft, 99)),
                    "mean": _ms(statistics.fmean(ttft) if ttft else None)},
        "ttft_ms_by_kind": by_kind, "later_over_first_turn_ttft_p50": reuse,
        "inter_chunk_gap": _gaps(ok),
        "tpot_ms_mean": _ms(statistics.fmean(tpot) if tpot else None),
        "rss_mib": {"before": before, "after": after, "peak_total": peak and round(peak, 1),
                    "growth_percent": growth},
    }


async def reference_texts(client: httpx.AsyncClient, args, model: str) -> dict[int, str]:
    """Each short prompt's output, one request at a time (what T = 0 outputs under load must equal)."""
    results = [await one_request(client, args, model, prompt, key=key) for key, prompt in enumerate(PROMPTS)]
    return {r.key: r.text for r in results if r.ok}


async def main_async(args) -> dict:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.clients + 4, max_keepalive_connections=args.clients + 4)
    async with httpx.AsyncClient(base_url=args.url, headers=headers, timeout=args.timeout, limits=limits,
                                 trust_env=False) as client:
        model = args.model
        if model is None:
            response = await client.get("/v1/models")
            if response.status_code == 401:
                raise SystemExit(f"error: {args.url} wants an API key: pass --api-key or set SSD_EAGLE_API_KEY")
            response.raise_for_status()
            model = response.json()["data"][0]["id"]
        pid = args.server_pid or find_listening_pid(urlparse(args.url).port or 80)
        counter = [0]
        if args.warmup > 0:
            print(f"warm-up: {args.clients} clients for {args.warmup:g} s of short requests ...", file=sys.stderr)
            await run_phase(client, argparse.Namespace(**{**vars(args), "mix": "short"}), model, args.warmup, counter)
        reference, record, restarts = {}, {}, None
        if args.kill_speculator is not None:
            print("reference outputs, one request at a time ...", file=sys.stderr)
            reference, restarts = await reference_texts(client, args, model), await restarts_total(client)
        before = memory(pid)
        peak = [before["total"] or 0.0]

        async def sample_rss():
            while True:
                peak[0] = max(peak[0], memory(pid)["total"] or 0.0)
                await asyncio.sleep(1.0)

        tasks = [asyncio.create_task(sample_rss())]
        if args.kill_speculator is not None:
            tasks.append(asyncio.create_task(kill_later(args.kill_speculator, pid, record)))
        print(f"measuring: {args.clients} clients ({args.mix}) for {args.duration:g} s against {args.url} "
              f"({model}), server pid {pid}, speculator {speculator_pids(pid)}", file=sys.stderr)
        counter[0] = 0
        try:
            phase = await run_phase(client, args, model, args.duration, counter)
        finally:
            for task in tasks:
                task.cancel()
        summary = summarize(phase, before, memory(pid), peak[0] if pid else None, args)
        if args.kill_speculator is not None:
            summary["speculator_kill"] = await kill_report(client, args, model, phase, reference, record, restarts)
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
    parser.add_argument("--mix", choices=["short", "long-prompt", "multi-turn"], default="short",
                        help="the requests sent (see above)")
    parser.add_argument("--long-tokens", type=int, default=4000, help="long-prompt: tokens of a long prompt")
    parser.add_argument("--long-share", type=float, default=0.25, help="long-prompt: share of long requests")
    parser.add_argument("--turns", type=int, default=3, help="multi-turn: turns per conversation")
    parser.add_argument("--context-tokens", type=int, default=1000,
                        help="multi-turn: tokens of each conversation's system document")
    parser.add_argument("--kill-speculator", type=float, default=None, metavar="SECONDS",
                        help="SIGKILL the server's speculator process this many seconds into the measured phase")
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
    if not 0 < args.long_share <= 1 or args.long_tokens < 1 or args.turns < 1 or args.context_tokens < 1:
        parser.error("need 0 < --long-share <= 1, --long-tokens, --turns and --context-tokens >= 1")
    if args.mix == "multi-turn" and args.endpoint != "chat":
        parser.error("--mix multi-turn needs --endpoint chat")
    summary = asyncio.run(main_async(args))
    print(json.dumps(summary, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
    return 0 if summary["errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
