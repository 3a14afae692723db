#!/usr/bin/env python3
"""loadgen.py - open-loop load generator for an OpenAI-compatible /v1/completions server, in
the shape of the field's serving benchmarks (vLLM's benchmark_serving: random input of a fixed
token count, fixed output with ignore_eos, requests arriving as a Poisson process at a rate or
all at once): output tokens/s, TTFT and TPOT percentiles. Standard library only (the GPU
machine has no PyPI).

Each request: prompt = INPUT random token ids drawn in [--id-lo, --id-hi) (seeded), max_tokens
OUTPUT, greedy, ignore_eos, streamed; usage from the final chunk gives the tokens generated.
TTFT = first streamed text chunk - send; TPOT = (end - first chunk) / (tokens - 1) per request
(vLLM's definition); output tokens/s = all generated tokens / (last end - first send).

Usage: loadgen.py --url http://127.0.0.1:8080 --requests 300 --rate 2|inf --input 1024
                  --output 512 [--seed 1] [--label NAME] [--timeout 1800]
Prints one JSON object on stdout; progress on stderr every 10 s. When the server is tqkv, the
object also holds the engine's split of the run from /metrics before and after: steps, mean
decode batch, seconds in prefill / decode / merge, and the served prefill rate.
"""
import argparse, asyncio, json, random, sys, time
from urllib.parse import urlparse


def percentile(xs, p):
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * p / 100.0
    i = int(k)
    return s[i] if i + 1 >= len(s) else s[i] + (s[i + 1] - s[i]) * (k - i)


async def one(host, port, path, body, res):
    """Send one streamed request; fill res with send, first, end, tokens, status."""
    res["send"] = time.perf_counter()
    try:
        reader, writer = await asyncio.open_connection(host, port)
        data = json.dumps(body).encode()
        writer.write((f"POST {path} HTTP/1.0\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                      f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n").encode() + data)
        await writer.drain()
        status = int((await reader.readline()).split()[1])
        res["status"] = status
        while (await reader.readline()) not in (b"\r\n", b""):
            pass                                   # headers
        buf = b""
        while True:
            chunk = await reader.read(65536)
            if not chunk:
                break
            buf += chunk
            while b"\n\n" in buf:
                ev, buf = buf.split(b"\n\n", 1)
                for line in ev.split(b"\n"):      # chunked transfer lines are skipped
                    if not line.startswith(b"data: ") or line == b"data: [DONE]":
                        continue
                    j = json.loads(line[6:])
                    if j.get("error") and "error" not in res:   # a mid-stream failure
                        res["error"] = str(j["error"].get("message", j["error"]))
                    fr = (j.get("choices") or [{}])[0].get("finish_reason")
                    if fr == "error" and "error" not in res:
                        res["error"] = "finish_reason error"
                    if j.get("usage"):
                        res["tokens"] = j["usage"]["completion_tokens"]
                    ch = (j.get("choices") or [{}])[0]
                    if ch.get("text") is not None and "first" not in res:
                        res["first"] = time.perf_counter()
        writer.close()
    except Exception as e:  # noqa: BLE001 - a failed request is counted, not fatal
        res["error"] = repr(e)
    res["end"] = time.perf_counter()


ENGINE_METRICS = ("tqkv_engine_steps_total", "tqkv_engine_decode_steps_total",
                  "tqkv_engine_decode_rows_total", "tqkv_engine_prefill_seconds_total",
                  "tqkv_engine_decode_seconds_total", "tqkv_engine_merge_seconds_total",
                  "tqkv_prefill_tokens_total")


async def metrics(host, port):
    """The server's engine counters (ENGINE_METRICS) from GET /metrics; {} when absent."""
    try:
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(f"GET /metrics HTTP/1.0\r\nHost: {host}\r\n\r\n".encode())
        await writer.drain()
        text = (await reader.read()).decode(errors="replace")
        writer.close()
    except Exception:  # noqa: BLE001 - the figures are extra, not required
        return {}
    out = {}
    for line in text.split("\n"):
        f = line.split()
        if len(f) == 2 and f[0] in ENGINE_METRICS:
            out[f[0]] = float(f[1])
    return out


def engine_split(m0, m1):
    """Where the server's time went between two scrapes: steps, mean decode batch, seconds
    in prefill / decode / merge and the served prefill rate."""
    if not all(k in m0 and k in m1 for k in ENGINE_METRICS):
        return {}
    d = {k: m1[k] - m0[k] for k in ENGINE_METRICS}
    ds, pre = d["tqkv_engine_decode_steps_total"], d["tqkv_engine_prefill_seconds_total"]
    return {"engine_steps": int(d["tqkv_engine_steps_total"]), "engine_decode_steps": int(ds),
            "engine_mean_decode_rows": round(d["tqkv_engine_decode_rows_total"] / ds, 2) if ds else None,
            "engine_prefill_s": round(pre, 3),
            "engine_decode_s": round(d["tqkv_engine_decode_seconds_total"], 3),
            "engine_merge_s": round(d["tqkv_engine_merge_seconds_total"], 3),
            "engine_prefill_tokens_per_s":
                round(d["tqkv_prefill_tokens_total"] / pre, 1) if pre > 0 else None}


async def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="http://127.0.0.1:8080")
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--rate", type=float, default=float("inf"), help="requests/s (inf: burst)")
    ap.add_argument("--input", type=int, default=1024)
    ap.add_argument("--output", type=int, default=512)
    ap.add_argument("--id-lo", type=int, default=1000)
    ap.add_argument("--id-hi", type=int, default=8000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--label", default="")
    ap.add_argument("--timeout", type=float, default=1800)
    a = ap.parse_args()
    u = urlparse(a.url)
    rng = random.Random(a.seed)
    results = [{} for _ in range(a.requests)]
    tasks, t0 = [], time.perf_counter()

    async def progress():
        while True:
            await asyncio.sleep(10)
            done = sum(1 for r in results if "end" in r)
            print(f"loadgen {a.label}: {done}/{a.requests} done, {time.perf_counter() - t0:.0f} s",
                  file=sys.stderr, flush=True)

    m0 = await metrics(u.hostname, u.port or 80)
    prog = asyncio.ensure_future(progress())
    for i in range(a.requests):
        body = {"prompt": [rng.randrange(a.id_lo, a.id_hi) for _ in range(a.input)],
                "max_tokens": a.output, "temperature": 0, "stream": True, "ignore_eos": True,
                "stream_options": {"include_usage": True}}
        tasks.append(asyncio.ensure_future(one(u.hostname, u.port or 80, "/v1/completions", body,
                                               results[i])))
        if a.rate != float("inf") and i + 1 < a.requests:
            await asyncio.sleep(rng.expovariate(a.rate))
    await asyncio.wait_for(asyncio.gather(*tasks), a.timeout)
    prog.cancel()
    ok = [r for r in results if r.get("status") == 200 and "first" in r and r.get("tokens")]
    ttft = [r["first"] - r["send"] for r in ok]
    tpot = [(r["end"] - r["first"]) / (r["tokens"] - 1) for r in ok if r["tokens"] > 1]
    span = max(r["end"] for r in results) - min(r["send"] for r in results)
    tokens = sum(r["tokens"] for r in ok)
    out = {"label": a.label, "requests": a.requests, "completed": len(ok),
           "failed": a.requests - len(ok), "rate": "burst" if a.rate == float("inf") else a.rate,
           "input_tokens": a.input, "output_tokens": a.output, "duration_s": round(span, 3),
           "output_tokens_per_s": round(tokens / span, 2) if span > 0 else None,
           "request_per_s": round(len(ok) / span, 3) if span > 0 else None,
           "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
           "tpot_p50_s": percentile(tpot, 50), "tpot_p99_s": percentile(tpot, 99)}
    out.update(engine_split(m0, await metrics(u.hostname, u.port or 80)))
    errs = [r.get("error") or r.get("status") for r in results if r not in ok]
    if errs:
        out["first_error"] = str(errs[0])
    print(json.dumps(out))


if __name__ == "__main__":
    asyncio.run(main())
