// loadgen.mjs - closed-loop load generator for an OpenAI-compatible /v1/completions server
// (tqkv serve, llama-server). C workers each send one streamed request at a time (greedy,
// max_tokens M, prompts cut from a text file), for D seconds. Every token is one SSE chunk
// (logprobs: 0 makes the server send a chunk per token even when its text is held back).
// Reports on stdout one JSON line: aggregate generated tokens/s over the window (tokens
// streamed inside it, in-flight requests included), p50/p99 time to first token, inter-token
// latency and request latency (requests started and finished inside the window), requests
// completed, prompt tokens mean. --warmup W: run W seconds before the window opens.
// usage: node loadgen.mjs --url http://127.0.0.1:8080 --streams 16 --duration 60
//          --max-tokens 128 --prompt-file heldout-code.txt --prompt-chars 700 [--seed 1]
const args = Object.fromEntries(process.argv.slice(2).reduce((a, v, i, all) =>
  (v.startsWith('--') ? a.push([v.slice(2), all[i + 1]]) : a, a), []));
const url = (args.url ?? 'http://127.0.0.1:8080') + '/v1/completions';
const C = +(args.streams ?? 1), D = +(args.duration ?? 60) * 1000, M = +(args['max-tokens'] ?? 128);
const chars = +(args['prompt-chars'] ?? 700);
const fs = await import('node:fs');
const text = fs.readFileSync(args['prompt-file']).toString('utf8');
let rng = BigInt(+(args.seed ?? 1));
const rand = (n) => { rng = (rng * 6364136223846793005n + 1442695040888963407n) & ((1n << 64n) - 1n);
                      return Number((rng >> 33n) % BigInt(n)); };
const prompts = Array.from({ length: 512 }, () => {
  const off = rand(text.length - chars - 1);
  return text.slice(off, off + chars);
});

const W = +(args.warmup ?? 0) * 1000; // requests run but are not measured before t0
const tStart = performance.now(), t0 = tStart + W, tEnd = t0 + D;
let tokensInWindow = 0, completed = 0, failed = 0, promptTokens = 0;
const ttft = [], itl = [], lat = [];

async function one(prompt, ctrl) {
  const start = performance.now();
  const res = await fetch(url, { method: 'POST', signal: ctrl.signal,
    headers: { 'Content-Type': 'application/json', ...(args.key ? { Authorization: 'Bearer ' + args.key } : {}) },
    body: JSON.stringify({ prompt, max_tokens: M, temperature: 0, stream: true, logprobs: 0,
                           stream_options: { include_usage: true }, ignore_eos: true }) });
  if (res.status !== 200) { failed++; await res.text(); return; }
  const dec = new TextDecoder();
  let buf = '', last = 0, first = true, usage = null;
  for await (const part of res.body) {
    buf += dec.decode(part, { stream: true });
    let k;
    while ((k = buf.indexOf('\n\n')) >= 0) {
      const ev = buf.slice(0, k); buf = buf.slice(k + 2);
      if (!ev.startsWith('data: ') || ev === 'data: [DONE]') continue;
      const j = JSON.parse(ev.slice(6));
      if (j.usage) usage = j.usage;
      const ch = j.choices?.[0];
      if (!ch) continue;
      const n = ch.logprobs?.tokens?.length ?? ch.logprobs?.content?.length ?? (ch.text ? 1 : 0);
      if (!n) continue;
      const now = performance.now();
      const inWin = now >= t0 && now <= tEnd;
      if (inWin) tokensInWindow += n;
      if (first) { if (start >= t0 && now <= tEnd) ttft.push(now - start); first = false; }
      else if (inWin) itl.push(now - last);
      last = now;
    }
  }
  const end = performance.now();
  if (start >= t0 && end <= tEnd) { completed++; lat.push(end - start); if (usage) promptTokens += usage.prompt_tokens; }
}

async function worker(w) {
  const ctrl = new AbortController();
  const timer = setTimeout(() => ctrl.abort(), Math.max(0, tEnd - performance.now()));
  let i = w;
  while (performance.now() < tEnd) {
    try { await one(prompts[(i++ * 7919) % prompts.length], ctrl); }
    catch (e) { if (performance.now() < tEnd) { failed++; } }
  }
  clearTimeout(timer);
}
await Promise.all(Array.from({ length: C }, (_, w) => worker(w)));
const pct = (a, p) => { if (!a.length) return null; const s = [...a].sort((x, y) => x - y);
  return +(s[Math.min(s.length - 1, Math.floor(p / 100 * s.length))] / 1000).toFixed(4); };
console.log(JSON.stringify({ streams: C, duration_s: D / 1000, warmup_s: W / 1000, max_tokens: M,
  tokens_per_s: +(tokensInWindow / (D / 1000)).toFixed(1), requests_completed: completed, failed,
  prompt_tokens_mean: completed ? +(promptTokens / completed).toFixed(1) : null,
  ttft_p50_s: pct(ttft, 50), ttft_p99_s: pct(ttft, 99), itl_p50_s: pct(itl, 50), itl_p99_s: pct(itl, 99),
  latency_p50_s: pct(lat, 50), latency_p99_s: pct(lat, 99) }));
