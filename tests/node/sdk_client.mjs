// The openai Node SDK, as its users call it, against a running LMSP server (tests/test_node_sdk.py).
//
//   LMSP_BASE_URL=http://127.0.0.1:PORT/lmsp/v1 LMSP_TOKEN=... LMSP_MODEL=tiny node sdk_client.mjs SCENARIO
//
// Prints one JSON object (what the scenario saw) on stdout; the Python test compares it with what
// the server stored. Any exception (an SDK error, a stream helper refusing an event) ends the
// process with status 1 and the error on stderr.
import OpenAI from 'openai';
import { ResponseStream } from 'openai/lib/responses/ResponseStream';

const model = process.env.LMSP_MODEL;
const client = new OpenAI({
  baseURL: process.env.LMSP_BASE_URL,
  apiKey: process.env.LMSP_TOKEN,
  maxRetries: 0,
  timeout: 60_000,
});

// Greedy, and long enough for the test model to reach end-of-sequence: `completed`.
const COMPLETES = { input: 'Hello', temperature: 0, max_output_tokens: 256 };
const SHORT = { input: 'Hello there', temperature: 0, max_output_tokens: 12 };
const WEATHER_TOOL = {
  type: 'function',
  name: 'get_weather',
  description: 'The weather in a city.',
  parameters: {
    type: 'object',
    properties: { city: { type: 'string', maxLength: 12 }, unit: { enum: ['c', 'f'] } },
    required: ['city', 'unit'],
    additionalProperties: false,
  },
  strict: true,
};
const TERMINAL = new Set(['completed', 'incomplete', 'failed', 'cancelled']);

function summary(response) {
  return {
    id: response.id,
    object: response.object,
    status: response.status,
    model: response.model,
    output_text: response.output_text,
    output: response.output.map((item) => ({
      type: item.type,
      id: item.id,
      ...(item.type === 'function_call'
        ? { name: item.name, call_id: item.call_id, arguments: item.arguments }
        : {}),
    })),
    usage: response.usage ?? null,
  };
}

function eventSummary(event) {
  return { type: event.type, sequence_number: event.sequence_number };
}

// responses.stream(): the helper accumulates every event into a snapshot and throws on an event
// type it does not know, so a stream the helper accepts has only types the SDK knows.
async function streamed(params) {
  const stream = client.responses.stream(params);
  const events = [];
  let textSnapshot = null;
  stream.on('response.output_text.delta', (event) => {
    textSnapshot = event.snapshot;
  });
  for await (const event of stream) {
    events.push(eventSummary(event));
  }
  const final = await stream.finalResponse();
  return { events, text_snapshot: textSnapshot, final: summary(final) };
}

async function waitFinished(id) {
  const deadline = Date.now() + 60_000;
  for (;;) {
    const response = await client.responses.retrieve(id);
    if (TERMINAL.has(response.status)) return response;
    if (Date.now() > deadline) throw new Error(`${id} did not finish: ${response.status}`);
    await new Promise((resolve) => setTimeout(resolve, 50));
  }
}

const scenarios = {
  async create() {
    const response = await client.responses.create({ model, ...SHORT });
    const retrieved = await client.responses.retrieve(response.id);
    return { created: summary(response), retrieved: summary(retrieved) };
  },

  async stream() {
    return streamed({ model, ...COMPLETES });
  },

  // The lower-level call: create({stream: true}) gives the raw events to iterate.
  async create_stream() {
    const stream = await client.responses.create({ model, ...COMPLETES, stream: true });
    const events = [];
    let text = '';
    let final = null;
    for await (const event of stream) {
      events.push(eventSummary(event));
      if (event.type === 'response.output_text.delta') text += event.delta;
      if (event.type === 'response.completed') final = summary(event.response);
    }
    return { events, deltas: text, final };
  },

  // A background response, polled with retrieve(), then followed again from a sequence
  // number with responses.stream({response_id, starting_after}).
  async background() {
    const started = await client.responses.create({ model, ...COMPLETES, background: true });
    const finished = await waitFinished(started.id);
    const resumed = await streamed({ response_id: started.id, starting_after: 2 });
    return {
      started: { id: started.id, status: started.status, background: started.background },
      finished: summary(finished),
      resumed,
    };
  },

  // A function call streamed through the helper, its output sent back, and the answer.
  async tool_round_trip() {
    const asked = await streamed({
      model,
      input: 'What is the weather in Paris?',
      tools: [WEATHER_TOOL],
      tool_choice: 'required',
      parallel_tool_calls: false,
      temperature: 0,
      max_output_tokens: 300,
    });
    const call = asked.final.output.find((item) => item.type === 'function_call');
    const answered = await client.responses.create({
      model,
      previous_response_id: asked.final.id,
      input: [{ type: 'function_call_output', call_id: call.call_id, output: 'sunny, 21' }],
      tools: [WEATHER_TOOL],
      tool_choice: 'none',
      temperature: 0,
      max_output_tokens: 8,
    });
    const inputItems = [];
    for await (const item of client.responses.inputItems.list(answered.id)) {
      inputItems.push({ type: item.type, call_id: item.call_id ?? null });
    }
    return { asked, call, answered: summary(answered), input_items: inputItems };
  },

  // Chat completions: create({stream: true}) chunks, then the stream() helper's final completion.
  async chat_stream() {
    const body = {
      model,
      messages: [{ role: 'user', content: 'Hello there' }],
      temperature: 0,
      max_tokens: 12,
    };
    const chunks = await client.chat.completions.create({ ...body, stream: true });
    let text = '';
    let finish = null;
    let id = null;
    let count = 0;
    for await (const chunk of chunks) {
      count += 1;
      id = chunk.id;
      for (const choice of chunk.choices) {
        text += choice.delta?.content ?? '';
        finish = choice.finish_reason ?? finish;
      }
    }
    const helper = client.chat.completions.stream(body);
    const kinds = new Set();
    helper.on('content', () => kinds.add('content'));
    const completion = await helper.finalChatCompletion();
    const plain = await client.chat.completions.create(body);
    return {
      streamed: { id, chunks: count, text, finish_reason: finish },
      helper: {
        kinds: [...kinds],
        text: completion.choices[0].message.content,
        finish_reason: completion.choices[0].finish_reason,
      },
      plain: {
        text: plain.choices[0].message.content,
        finish_reason: plain.choices[0].finish_reason,
      },
    };
  },

  async auth_error() {
    const bad = new OpenAI({ baseURL: process.env.LMSP_BASE_URL, apiKey: 'wrong', maxRetries: 0 });
    try {
      await bad.responses.create({ model, ...SHORT });
    } catch (error) {
      return {
        class: error.constructor.name,
        is_authentication_error: error instanceof OpenAI.AuthenticationError,
        status: error.status,
        type: error.type ?? null,
      };
    }
    throw new Error('a bad token was accepted');
  },

  // No server: shows that this SDK's stream helper refuses an event type it does not know (the
  // server once sent `response.loading`), so the scenarios above would fail on one.
  async unknown_event_canary() {
    const response = {
      id: 'resp_canary',
      object: 'response',
      created_at: 0,
      status: 'in_progress',
      model,
      output: [],
      tools: [],
    };
    const lines = [
      { type: 'response.created', sequence_number: 0, response },
      { type: 'response.loading', sequence_number: 1, response },
      { type: 'response.completed', sequence_number: 2, response: { ...response, status: 'completed' } },
    ];
    const body = new ReadableStream({
      start(controller) {
        for (const line of lines) controller.enqueue(new TextEncoder().encode(JSON.stringify(line) + '\n'));
        controller.close();
      },
    });
    const stream = ResponseStream.fromReadableStream(body);
    try {
      await stream.finalResponse();
    } catch (error) {
      return { refused: true, message: String(error.message ?? error) };
    }
    return { refused: false };
  },
};

const name = process.argv[2];
if (!(name in scenarios)) {
  console.error(`unknown scenario ${name}; one of: ${Object.keys(scenarios).join(', ')}`);
  process.exit(2);
}
try {
  const result = await scenarios[name]();
  process.stdout.write(JSON.stringify(result) + '\n');
} catch (error) {
  console.error(error?.stack ?? String(error));
  process.exit(1);
}
