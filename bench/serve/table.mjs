// table.mjs [results.jsonl] - the serving benchmark as Markdown tables (for bench/RESULTS.md).
const fs = await import('node:fs');
const file = process.argv[2] ?? new URL('./results.jsonl', import.meta.url).pathname;
const rows = fs.readFileSync(file, 'utf8').split('\n').filter(Boolean).map(JSON.parse);
const cap = rows.find(r => r.capacity)?.capacity;
const f = (x, d = 2) => x == null ? '-' : (+x).toFixed(d);
console.log('| KV | streams | generated tok/s | TTFT p50 / p99 (s) | ITL p50 / p99 (ms) | request latency p50 (s) | requests | prompt tokens | load avg |');
console.log('|---|---|---|---|---|---|---|---|---|');
for (const r of rows.filter(r => r.label === 'sweep'))
  console.log(`| ${r.kv} | ${r.streams} | ${f(r.tokens_per_s, 1)} | ${f(r.ttft_p50_s)} / ${f(r.ttft_p99_s)} | ` +
    `${f(r.itl_p50_s * 1000, 1)} / ${f(r.itl_p99_s * 1000, 1)} | ${f(r.latency_p50_s)} | ${r.requests_completed} | ` +
    `${f(r.prompt_tokens_mean, 0)} | ${r.loadavg.split(' ')[0]} |`);
if (cap) {
  console.log(`\nHeadline: KV budget ${cap.budget_bytes} bytes, conversations of ${cap.tokens} tokens.\n`);
  console.log('| KV | KV bytes/token | projected bytes/conversation | conversations | vs f16 | generated tok/s at that concurrency | TTFT p50 (s) | ITL p50 / p99 (ms) | prompt tokens | load avg |');
  console.log('|---|---|---|---|---|---|---|---|---|---|');
  const base = cap.formats.find(x => x.kv === 'f16')?.conversations;
  for (const c of cap.formats) {
    const h = rows.find(r => r.label === 'headline-2048' && r.kv === c.kv) ?? {};
    console.log(`| ${c.kv} | ${c.kv_bytes_per_token} | ${c.projected_bytes} | ${c.conversations} | ` +
      `${base ? (c.conversations / base).toFixed(2) + 'x' : '-'} | ${f(h.tokens_per_s, 1)} | ${f(h.ttft_p50_s)} | ` +
      `${f(h.itl_p50_s * 1000, 1)} / ${f(h.itl_p99_s * 1000, 1)} | ${f(h.prompt_tokens_mean, 0)} | ${h.loadavg?.split(' ')[0] ?? '-'} |`);
  }
}
