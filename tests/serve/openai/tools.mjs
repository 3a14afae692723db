// tools.mjs BASE_URL API_KEY - tool calls through the official openai npm client against
// a server whose every output is "Checking.\n<tool_call>{get_weather Paris 2}</tool_call>"
// (run_tools.sh): the whole response's message.tool_calls, the streamed response
// assembled by the client's own stream helper (delta.tool_calls), tool_choice named and
// none, and a round trip (assistant tool_calls + tool message in the history).
import OpenAI from 'openai';

const [base, key] = process.argv.slice(2);
const client = new OpenAI({ baseURL: base, apiKey: key, maxRetries: 0, timeout: 60000 });
const fail = (m) => { console.error('FAIL: ' + m); process.exit(1); };
const eq = (a, b, what) => { if (JSON.stringify(a) !== JSON.stringify(b)) fail(`${what}: ${JSON.stringify(a)} != ${JSON.stringify(b)}`); };

const tools = [{ type: 'function', function: { name: 'get_weather', description: 'Weather of a city',
  parameters: { type: 'object', properties: { city: { type: 'string' }, days: { type: 'integer' } }, required: ['city'] } } }];
const messages = [{ role: 'user', content: 'Weather in Paris for two days?' }];

const c = await client.chat.completions.create({ model: 'fake-model', messages, tools });
const m = c.choices[0].message;
eq(c.choices[0].finish_reason, 'tool_calls', 'finish_reason');
eq(m.content, 'Checking.', 'content before the call');
eq(m.tool_calls.length, 1, 'one call');
eq(m.tool_calls[0].type, 'function', 'type');
eq(m.tool_calls[0].function.name, 'get_weather', 'name');
eq(JSON.parse(m.tool_calls[0].function.arguments), { city: 'Paris', days: 2 }, 'arguments');

// streamed: the client's helper assembles delta.tool_calls into the final message
const stream = client.chat.completions.stream({ model: 'fake-model', messages, tools,
  tool_choice: { type: 'function', function: { name: 'get_weather' } } });
let deltas = 0;
stream.on('chunk', (ch) => { if (ch.choices[0]?.delta?.tool_calls) deltas++; });
const fin = await stream.finalChatCompletion();
const fm = fin.choices[0].message;
if (deltas < 1) fail('no delta.tool_calls chunk');
eq(fin.choices[0].finish_reason, 'tool_calls', 'streamed finish_reason');
eq(fm.tool_calls.length, 1, 'streamed: one call');
eq(fm.tool_calls[0].function.name, 'get_weather', 'streamed name');
eq(JSON.parse(fm.tool_calls[0].function.arguments), { city: 'Paris', days: 2 }, 'streamed arguments');
if ((fm.content ?? '').includes('<tool_call>')) fail('call markup streamed as content');

// tool_choice none: plain content, no calls
const n = await client.chat.completions.create({ model: 'fake-model', messages, tools, tool_choice: 'none' });
if (n.choices[0].message.tool_calls?.length) fail('tool_choice none gave calls');
if (!n.choices[0].message.content.includes('<tool_call>')) fail('tool_choice none: content lost');

// round trip: the assistant message as the client got it, then the tool's answer
const history = [...messages, m, { role: 'tool', tool_call_id: m.tool_calls[0].id, content: '18 C, sunny' }];
const r2 = await client.chat.completions.create({ model: 'fake-model', messages: history, tools });
eq(r2.object, 'chat.completion', 'round trip');

// a wrong type is an APIError naming the parameter
try {
  await client.chat.completions.create({ model: 'fake-model', messages, tools: 'get_weather' });
  fail('tools as a string accepted');
} catch (e) {
  if (!(e instanceof OpenAI.APIError) || e.status !== 400) fail('expected APIError 400, got ' + e);
  eq(e.param, 'tools', 'error param');
}
console.log('openai tools: ok');
