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
