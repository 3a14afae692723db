// client.mjs BASE_URL API_KEY CHAT(0|1) - drive tqkv serve with the official openai npm
// client as an application would: list models, a completion, the same completion
// streamed (texts must match, usage on the last chunk), a chat completion streamed and
// not (when the build has chat templates), logprobs, and an error surfaced as an APIError.
import OpenAI from 'openai';

const [base, key, chatArg] = process.argv.slice(2);
const client = new OpenAI({ baseURL: base, apiKey: key, maxRetries: 0, timeout: 120000 });
const fail = (m) => { console.error('FAIL: ' + m); process.exit(1); };
const eq = (a, b, what) => { if (a !== b) fail(`${what}: ${JSON.stringify(a)} != ${JSON.stringify(b)}`); };

const models = await client.models.list();
const ids = [];
for await (const m of models) ids.push(m.id);
if (ids.length !== 1) fail('models: ' + JSON.stringify(ids));
const model = ids[0];

const prompt = 'def fibonacci(n):\n    ';
const whole = await client.completions.create({ model, prompt, max_tokens: 24, temperature: 0, logprobs: 2 });
const text = whole.choices[0].text;
if (!text.length) fail('empty completion');
eq(whole.choices[0].logprobs.tokens.length, 24, 'logprobs tokens');
eq(whole.usage.completion_tokens, 24, 'usage');

let streamed = '', usage = null, chunks = 0;
const stream = await client.completions.create({ model, prompt, max_tokens: 24, temperature: 0,
  stream: true, stream_options: { include_usage: true } });
for await (const ch of stream) {
  chunks++;
  if (ch.choices.length) streamed += ch.choices[0].text;
  if (ch.usage) usage = ch.usage;
}
eq(streamed, text, 'streamed completion == non-streamed');
if (!usage || usage.completion_tokens !== 24) fail('stream usage ' + JSON.stringify(usage));
if (chunks < 3) fail('too few chunks: ' + chunks);

if (chatArg === '1') {
  const messages = [{ role: 'system', content: 'You write Python.' },
                    { role: 'user', content: 'Write a function that adds two numbers.' }];
  const c = await client.chat.completions.create({ model, messages, max_tokens: 20, temperature: 0,
    logprobs: true, top_logprobs: 2 });
  const ctext = c.choices[0].message.content;
  eq(c.choices[0].message.role, 'assistant', 'role');
  eq(c.choices[0].logprobs.content.length, c.usage.completion_tokens, 'chat logprobs');
  let cs = '';
  const cstream = await client.chat.completions.create({ model, messages, max_tokens: 20, temperature: 0, stream: true });
  for await (const ch of cstream) cs += ch.choices[0]?.delta?.content ?? '';
  eq(cs, ctext, 'streamed chat == non-streamed');
}

// n = 4 greedy: every choice equals a single request, and the prompt is prefilled once
// (tqkv_prefill_tokens_total of /metrics, outside the API key, grows by the prompt once)
const metric = async (name) => {
  const t = await (await fetch(base.replace(/\/v1$/, '') + '/metrics')).text();
  const m = t.match(new RegExp('^' + name + ' (\\d+)$', 'm'));
  if (!m) fail('metric ' + name + ' missing');
  return Number(m[1]);
};
const nprompt = `# ${Date.now()} unique\nclass Stack:\n    def push(self, x):\n        `;
const before = await metric('tqkv_prefill_tokens_total');
const four = await client.completions.create({ model, prompt: nprompt, max_tokens: 16, temperature: 0, n: 4, logprobs: 1 });
const mid = await metric('tqkv_prefill_tokens_total');
eq(four.choices.length, 4, 'n=4 choices');
eq(mid - before, four.usage.prompt_tokens, 'n=4: one prefill');
for (let i = 0; i < 4; i++) {
  const one = await client.completions.create({ model, prompt: nprompt, max_tokens: 16, temperature: 0, logprobs: 1 });
  eq(four.choices[i].index, i, 'choice index');
  eq(four.choices[i].text, one.choices[0].text, `n=4 choice ${i} == single request`);
  eq(four.choices[i].logprobs.tokens.length, 16, `choice ${i} logprobs`);
}
eq(four.usage.completion_tokens, 64, 'n=4 usage');
const after = await metric('tqkv_prefill_tokens_total');
if (after - mid < 4 * four.usage.prompt_tokens - 4 * 256) fail('four single requests prefilled too little');

// penalties and logit_bias change a greedy output; banning its first token moves it
const base0 = await client.completions.create({ model, prompt, max_tokens: 24, temperature: 0 });
const pen = await client.completions.create({ model, prompt, max_tokens: 24, temperature: 0,
  frequency_penalty: 2, presence_penalty: 2 });
if (pen.choices[0].text === base0.choices[0].text) fail('penalties changed nothing');
// logit_bias +100 on one (ordinary) id forces it: every generated token is that token
const biased = await client.completions.create({ model, prompt, max_tokens: 6, temperature: 0,
  logit_bias: { '500': 100 }, logprobs: 0 });
const bt = biased.choices[0].logprobs.tokens;
eq(bt.length, 6, 'biased tokens');
if (!bt[0].length || !bt.every((t) => t === bt[0])) fail('logit_bias +100 did not force one token: ' + JSON.stringify(bt));
eq(biased.choices[0].text, bt.join(''), 'biased text');
if (base0.choices[0].text.startsWith(bt[0].repeat(6))) fail('logit_bias changed nothing');

// response_format json_object: the content is one JSON object (constrained decoding)
if (chatArg === '1') {
  let closed = 0;
  for (const [i, t] of [[0, 0], [1, 0.8], [2, 0.8]]) {
    const j = await client.chat.completions.create({ model, max_tokens: 200, temperature: t, seed: i,
      response_format: { type: 'json_object' },
      messages: [{ role: 'user', content: `Describe item ${i} as JSON.` }] });
    const out = j.choices[0].message.content;
    if (!out.trimStart().startsWith('{')) fail('json_object output does not start an object: ' + out);
    if (j.choices[0].finish_reason === 'stop') {
      const v = JSON.parse(out);
      if (typeof v !== 'object' || Array.isArray(v) || v === null) fail('json_object gave ' + out);
      closed++;
    }
  }
  console.log(`json_object: ${closed} of 3 closed within 200 tokens, all parsed`);
}

// response_format json_schema (strict): 100 schemas of a fixed corpus (a seeded
// generator: the same schemas every run); every output that closed within max_tokens
// parses and validates against its schema
if (chatArg === '1') {
  let seed = 2701;
  const rnd = () => { seed = (seed * 1103515245 + 12345) % 2147483648; return seed / 2147483648; };
  const pick = (a) => a[Math.floor(rnd() * a.length)];
  const names = ['id', 'name', 'title', 'count', 'price', 'tags', 'active', 'kind', 'note', 'size'];
  const node = (depth) => {
    const k = Math.floor(rnd() * (depth >= 2 ? 7 : 9));
    if (k === 0) return { type: 'string' };
    if (k === 1) return { type: 'integer' };
    if (k === 2) return { type: 'number' };
    if (k === 3) return { type: 'boolean' };
    if (k === 4) return { type: [pick(['string', 'integer']), 'null'] };
    if (k === 5) return { type: 'string', enum: ['red', 'green', 'blue', 'small'].slice(0, 2 + Math.floor(rnd() * 3)) };
    if (k === 6) return { enum: [1, 2, 10, 20] };
    if (k === 7) return { type: 'array', items: node(depth + 1) };
    return object(depth + 1);
  };
  const object = (depth) => {
    const properties = {};
    const n = 1 + Math.floor(rnd() * (depth === 0 ? 4 : 3));
    for (let i = 0; i < n; i++) properties[pick(names) + '_' + i] = node(depth);
    return { type: 'object', properties, required: Object.keys(properties), additionalProperties: false };
  };
  const typeOk = (v, t) => t === 'string' ? typeof v === 'string' : t === 'number' ? typeof v === 'number'
    : t === 'integer' ? Number.isInteger(v) : t === 'boolean' ? typeof v === 'boolean' : t === 'null' ? v === null
    : t === 'array' ? Array.isArray(v) : t === 'object' ? (v !== null && typeof v === 'object' && !Array.isArray(v)) : false;
  const valid = (sch, v) => {
    if (sch.enum) return sch.enum.some((e) => e === v);
    const ts = Array.isArray(sch.type) ? sch.type : [sch.type];
    if (!ts.some((t) => typeOk(v, t))) return false;
    if (sch.properties && typeOk(v, 'object')) {
      const keys = Object.keys(sch.properties);
      if (Object.keys(v).length !== keys.length) return false;
      return keys.every((k) => k in v && valid(sch.properties[k], v[k]));
    }
    if (sch.items && Array.isArray(v)) return v.every((x) => valid(sch.items, x));
    return true;
  };
  const schemas = Array.from({ length: 100 }, () => object(0));
  let closed = 0, cutoff = 0;
  for (let b = 0; b < 100; b += 16) {
    await Promise.all(schemas.slice(b, b + 16).map(async (schema, k) => {
      const r = await client.chat.completions.create({ model, max_tokens: 256, temperature: (b + k) % 2 ? 0.7 : 0, seed: b + k,
        messages: [{ role: 'user', content: `Record ${b + k} as JSON.` }],
        response_format: { type: 'json_schema', json_schema: { name: `s${b + k}`, strict: true, schema } } });
      const out = r.choices[0].message.content;
      if (r.choices[0].finish_reason !== 'stop') { cutoff++; return; }
      let v;
      try { v = JSON.parse(out); } catch { fail(`schema ${b + k}: not JSON: ${out}`); }
      if (!valid(schema, v)) fail(`schema ${b + k} ${JSON.stringify(schema)}: invalid output ${out}`);
      closed++;
    }));
  }
  console.log(`json_schema: ${closed} of 100 closed within 256 tokens, all ${closed} valid; ${cutoff} cut by max_tokens`);
  if (closed < 50) fail('too few outputs closed: ' + closed);
}

// unknown fields are refused, naming the field
try {
  await client.completions.create({ model, prompt, max_tokens: 4, temprature: 0.5 });
  fail('unknown field accepted');
} catch (e) {
  if (!(e instanceof OpenAI.APIError) || e.status !== 400) fail('expected APIError 400, got ' + e);
  eq(e.param, 'temprature', 'unknown field param');
}

try {
  await client.completions.create({ model, prompt, max_tokens: 24, temperature: 9 });
  fail('temperature 9 accepted');
} catch (e) {
  if (!(e instanceof OpenAI.APIError) || e.status !== 400) fail('expected APIError 400, got ' + e);
  eq(e.param, 'temperature', 'error param');
}
try {
  await new OpenAI({ baseURL: base, apiKey: 'wrong', maxRetries: 0 }).models.list();
  fail('wrong key accepted');
} catch (e) {
  if (!(e instanceof OpenAI.AuthenticationError)) fail('expected AuthenticationError, got ' + e);
}
console.log(`openai ${OpenAI.VERSION ?? ''}: ok (completion ${text.length} chars, ${chunks} chunks, chat ${chatArg === '1'})`);
