'use strict';
/**
 * Node.js client of the twinplane Generation service (twinplane.v1, gRPC).
 *
 *     const { Client } = require('./twinplane');
 *     const client = new Client('127.0.0.1:50051');
 *     const stream = client.generate({ messages: [{ role: 'user', content: 'Hi!' }], maxTokens: 32 });
 *     for await (const chunk of stream) process.stdout.write(chunk.text);
 *     console.log(stream.final.finishReason, stream.final.usage);
 *     client.close();
 *
 * The contract, proto/generation.proto, is loaded at run time with @grpc/proto-loader, so
 * nothing is generated. Field names are camelCase (max_tokens is maxTokens) and enums are strings.
 * Requests are checked against the proto before they are sent: a field it does not have, or a value
 * its field cannot hold (a negative or fractional count, a number past 32 bits), throws a TypeError
 * naming the field. 64-bit integers (seed) take a number, a BigInt or a decimal string; replies
 * give numbers. A failed call rejects (or throws from the iteration) with grpc-js's ServiceError:
 * `code` (a grpc.status value), `details` (the server's message).
 */

const path = require('node:path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

const PROTO_PATH = path.join(__dirname, '..', '..', 'proto', 'generation.proto');
const definition = protoLoader.loadSync(PROTO_PATH, { longs: Number, enums: String, defaults: true });
const { Generation } = grpc.loadPackageDefinition(definition).twinplane.v1;

/** Field names of a twinplane.v1 message, as the loaded definition spells them (camelCase). */
function fieldNames(message) {
  return new Set(definition[`twinplane.v1.${message}`].type.field.map((field) => field.name));
}

const SAMPLING_FIELDS = fieldNames('SamplingParams');
const INPUT_FIELDS = new Set(['text', 'tokenIds', 'chat', 'sampling']); // set from the options below
const REQUEST_FIELDS = new Set([...fieldNames('GenerateRequest')].filter((name) => !INPUT_FIELDS.has(name)));

const FLOAT32_MAX = 3.4028234663852886e38;
const INTEGER_RANGES = {
  TYPE_INT32: [-(2n ** 31n), 2n ** 31n - 1n],
  TYPE_UINT32: [0n, 2n ** 32n - 1n],
  TYPE_INT64: [-(2n ** 63n), 2n ** 63n - 1n],
  TYPE_UINT64: [0n, 2n ** 64n - 1n],
};

/** A value as the TypeError that refuses it quotes it. */
function shown(value) {
  return typeof value === 'string' ? `'${value}'` : String(value);
}

/** An integer of a proto integer type; 64-bit ones as decimal text, which the encoder takes whole. */
function checkedInteger(type, value, where) {
  const [low, high] = INTEGER_RANGES[type];
  const wide = type.endsWith('64');
  let integer = null;
  if (typeof value === 'number' && Number.isSafeInteger(value)) integer = BigInt(value);
  else if (wide && typeof value === 'bigint') integer = value;
  else if (wide && typeof value === 'string' && /^-?\d+$/.test(value)) integer = BigInt(value);
  if (integer === null || integer < low || integer > high) {
    throw new TypeError(`${where} must be an integer in [${low}, ${high}]${wide ? ' (a number, BigInt or decimal '
      + 'string)' : ''}, got ${shown(value)}`);
  }
  return wide ? integer.toString() : Number(integer);
}

/** A value of a scalar field, as the encoder takes it; a TypeError when the field cannot hold it. */
function checkedScalar(field, value, where) {
  if (field.type in INTEGER_RANGES) return checkedInteger(field.type, value, where);
  const expected = {
    TYPE_STRING: ['string', 'a string'], TYPE_BOOL: ['boolean', 'true or false'],
    TYPE_FLOAT: ['number', 'a finite number'], TYPE_DOUBLE: ['number', 'a finite number'],
  }[field.type];
  if (expected === undefined) return value; // enums and bytes: the encoder checks them
  const tooWide = field.type === 'TYPE_FLOAT' && Math.abs(value) > FLOAT32_MAX; // the wire would carry inf
  if (typeof value !== expected[0] || (expected[0] === 'number' && !Number.isFinite(value)) || tooWide) {
    throw new TypeError(`${where} must be ${expected[1]}${field.type === 'TYPE_FLOAT' ? ' (32-bit)' : ''}, `
      + `got ${shown(value)}`);
  }
  return value;
}

/** The descriptor of a field's message type: the package's, or one nested in its parent (a map's entry). */
function messageType(parent, typeName) {
  const nested = parent.nestedType.find((type) => type.name === typeName);
  return nested ?? definition[`twinplane.v1.${typeName}`]?.type;
}

/**
 * A plain object checked against a message's descriptor, all the way down: every key must be one of
 * its fields and every value one the field can hold (else a TypeError naming the field, `where`).
 * Returns the object as the encoder takes it (64-bit integers as decimal text); google.protobuf
 * values pass as they are.
 */
function checked(type, object, where) {
  if (object === null || typeof object !== 'object' || Array.isArray(object)) {
    throw new TypeError(`${where} must be an object, got ${shown(object)}`);
  }
  const fields = new Map(type.field.map((field) => [field.name, field]));
  const out = {};
  for (const [key, value] of Object.entries(object)) {
    const field = fields.get(key);
    if (field === undefined) {
      throw new TypeError(`${where} has no field ${key}; its fields: ${[...fields.keys()].join(', ')}`);
    }
    if (value === undefined || value === null) continue;
    out[key] = checkedValue(type, field, value, `${where}.${key}`);
  }
  return out;
}

function checkedValue(parent, field, value, where) {
  const type = field.type === 'TYPE_MESSAGE' ? messageType(parent, field.typeName) : null;
  if (type?.options?.mapEntry) {
    const [keyField, valueField] = type.field;
    if (value === null || typeof value !== 'object') throw new TypeError(`${where} must be an object`);
    return Object.fromEntries(Object.entries(value).map(([k, v]) => [
      checkedScalar(keyField, keyField.type === 'TYPE_STRING' || !/^-?\d+$/.test(k) ? k : Number(k),
        `${where} key ${k}`),
      checkedValue(type, valueField, v, `${where}[${k}]`)]));
  }
  if (field.label === 'LABEL_REPEATED') {
    if (!Array.isArray(value)) throw new TypeError(`${where} must be an array, got ${shown(value)}`);
    return value.map((item, i) => checkedValue(parent, { ...field, label: 'LABEL_OPTIONAL' }, item, `${where}[${i}]`));
  }
  if (field.type !== 'TYPE_MESSAGE') return checkedScalar(field, value, where);
  return type === undefined ? value : checked(type, value, where);
}

/** A JSON value as a google.protobuf.Value. */
function valueOf(value) {
  if (value === null) return { nullValue: 'NULL_VALUE' };
  if (Array.isArray(value)) return { listValue: { values: value.map(valueOf) } };
  switch (typeof value) {
    case 'boolean': return { boolValue: value };
    case 'number': return { numberValue: value };
    case 'string': return { stringValue: value };
    case 'object': return { structValue: structOf(value) };
    default: throw new TypeError(`chatTemplateKwargs: ${typeof value} is no JSON value`);
  }
}

/** A plain object as a google.protobuf.Struct. */
function structOf(object) {
  return { fields: Object.fromEntries(Object.entries(object).map(([key, value]) => [key, valueOf(value)])) };
}

/** A tool as the proto's Tool: from the OpenAI API's {type: 'function', function} or the function alone. */
function toolOf(tool) {
  const fn = tool.function ?? tool;
  const { parameters } = fn;
  return { name: fn.name, description: fn.description ?? '',
    parameters: parameters === undefined || typeof parameters === 'string' ? parameters : JSON.stringify(parameters) };
}

/**
 * Chat messages as {role, content} objects (with toolCalls [{id, name, arguments}], toolCallId, name,
 * reasoningContent when needed) or [role, content] pairs, as a ChatInput, with the chat options:
 * addGenerationPrompt, continueFinalMessage, chatTemplateKwargs (an object of template variables,
 * e.g. { enable_thinking: false }), tools (see toolOf) and toolChoice ('required' or a tool's name forces
 * calls); undefined leaves the server's default.
 */
function chatInput(messages, options = {}) {
  const unknown = Object.keys(options).filter((key) => !CHAT_OPTIONS.includes(key));
  if (unknown.length) throw new TypeError(`unknown option ${unknown.join(', ')}`);
  const { addGenerationPrompt, continueFinalMessage, chatTemplateKwargs, tools, toolChoice } = options;
  if (!Array.isArray(messages)) throw new TypeError(`messages must be an array, got ${shown(messages)}`);
  const chat = { messages: messages.map(messageOf) };
  if (addGenerationPrompt !== undefined) chat.addGenerationPrompt = addGenerationPrompt;
  if (continueFinalMessage !== undefined) chat.continueFinalMessage = continueFinalMessage;
  if (chatTemplateKwargs !== undefined) chat.chatTemplateKwargs = structOf(chatTemplateKwargs);
  if (tools !== undefined) chat.tools = tools.map(toolOf);
  if (toolChoice !== undefined) chat.toolChoice = toolChoice;
  return chat;
}

const CHAT_OPTIONS = ['addGenerationPrompt', 'continueFinalMessage', 'chatTemplateKwargs', 'tools', 'toolChoice'];

/** A chat message from {role, content, ...} or [role, content]: it needs a role, and content unless it makes calls. */
function messageOf(message, i) {
  const m = Array.isArray(message) ? { role: message[0], content: message[1] } : message;
  if (m === null || typeof m !== 'object' || m.role === undefined || (m.content === undefined && !m.toolCalls)) {
    throw new TypeError(`messages[${i}] needs a role and content (or toolCalls), got ${JSON.stringify(message)}`);
  }
  return m;
}

/** Exactly one of inputs ({name: value}, messages among them) must be given, and chat options only with messages. */
function checkOneInput(inputs, chatOptions) {
  const names = Object.keys(inputs);
  if (Object.values(inputs).filter((value) => value !== undefined).length !== 1) {
    throw new TypeError(`give exactly one of ${names.slice(0, -1).join(', ')} or ${names.at(-1)}`);
  }
  const options = Object.keys(chatOptions).filter((key) => chatOptions[key] !== undefined);
  if (inputs.messages === undefined && options.length) {
    throw new TypeError(`${options.join(', ')}: options of chat messages, given without messages`);
  }
}

/** The prompt of a request: exactly one of `prompt` (text), `tokenIds` or `messages` (chat, with its options). */
function inputOf({ prompt, tokenIds, messages, ...chatOptions }) {
  checkOneInput({ prompt, tokenIds, messages }, chatOptions);
  if (prompt !== undefined) return { text: prompt };
  if (tokenIds !== undefined) return { tokenIds: { ids: tokenIds } };
  return { chat: chatInput(messages, chatOptions) };
}

/**
 * A GenerateRequest from flat options: the prompt and chat options (see inputOf), any SamplingParams field
 * (temperature, topP, topK, minP, seed, ...) and any other GenerateRequest field (maxTokens,
 * stop, ignoreEos, ...). Undefined or null leaves a field unset, so the server's default applies.
 */
function buildRequest(options) {
  const { prompt, tokenIds, messages, addGenerationPrompt, continueFinalMessage, chatTemplateKwargs, tools,
    toolChoice, ...rest } = options;
  const input = {
    prompt, tokenIds, messages, addGenerationPrompt, continueFinalMessage, chatTemplateKwargs, tools, toolChoice,
  };
  const request = { ...inputOf(input), sampling: {} };
  for (const [key, value] of Object.entries(rest)) {
    if (value === undefined || value === null) continue;
    if (SAMPLING_FIELDS.has(key)) request.sampling[key] = value;
    else if (REQUEST_FIELDS.has(key)) request[key] = key === 'stop' && typeof value === 'string' ? [value] : value;
    else throw new TypeError(`unknown option ${key}`);
  }
  const kinds = Object.keys(request.structuredOutput ?? {}).filter((key) => request.structuredOutput[key] != null);
  if (request.structuredOutput !== undefined && kinds.length !== 1) { // a oneof: the encoder would send them all
    throw new TypeError(`structuredOutput takes one of jsonSchema, jsonObject, regex and choice, got ${
      kinds.join(', ') || 'none'}`);
  }
  return checked(definition['twinplane.v1.GenerateRequest'].type, request, 'request');
}

/** 'FINISH_REASON_STOP_TOKEN' -> 'stop_token'; null while the stream runs; 'unknown' for a reason newer than
 * this copy of the proto (which arrives as a number). */
function finishReasonOf(name) {
  if (typeof name !== 'string') return 'unknown';
  return name === 'FINISH_REASON_UNSPECIFIED' ? null : name.replace('FINISH_REASON_', '').toLowerCase();
}

/**
 * One GenerateResponse as a plain chunk: every field of the message (see the proto), finishReason as
 * 'stop_token', 'length', ... (null but on the last chunk), which also alone carries usage. With
 * parseOutput: reasoningText, toolCalls and toolCallDeltas; with promptLogprobs, on the first chunk, the
 * prompt's log-probabilities (each position's `sampled` holds the prompt token, its logprob and rank).
 */
function chunkOf(response) {
  return {
    requestId: response.requestId,
    tokenIds: response.tokenIds,
    text: response.text,
    logprobs: response.logprobs,
    finishReason: finishReasonOf(response.finishReason),
    usage: response.usage,
    matchedStop: response.matchedStop,
    reasoningText: response.reasoningText,
    toolCalls: response.toolCalls,
    toolCallDeltas: response.toolCallDeltas,
    promptLogprobs: response.promptLogprobs,
  };
}

/**
 * A running Generate call. Iterate it once with `for await` for chunks; `final` is the last
 * chunk once the stream has ended. `cancel()`, or leaving the loop early, aborts the request
 * (the server frees its KV cache at once) and ends the iteration quietly.
 */
class GenerateStream {
  constructor(call) {
    this.call = call;
    this.cancelled = false;
    this.final = null;
  }

  async *[Symbol.asyncIterator]() {
    try {
      for await (const response of this.call) {
        const chunk = chunkOf(response);
        if (chunk.finishReason !== null) this.final = chunk;
        yield chunk;
      }
    } catch (error) {
      if (!(this.cancelled && error.code === grpc.status.CANCELLED)) throw error;
    } finally {
      if (this.final === null) this.cancel();
    }
  }

  /** Aborts the request. */
  cancel() {
    this.cancelled = true;
    this.call.cancel();
  }

  /** Consumes the stream and returns all of its text. */
  async text() {
    let text = '';
    for await (const chunk of this) text += chunk.text;
    return text;
  }
}

/**
 * Per-call options beside a request's: `timeout`, the seconds the call may take (DEADLINE_EXCEEDED
 * after), and `signal`, an AbortSignal that cancels the call (a Generate stream then ends quietly, a
 * unary call rejects with CANCELLED).
 */
function callOptionsOf({ timeout, signal } = {}) {
  if (timeout !== undefined && !(typeof timeout === 'number' && timeout > 0)) {
    throw new TypeError(`timeout must be a number of seconds > 0, got ${shown(timeout)}`);
  }
  return { options: timeout === undefined ? {} : { deadline: Date.now() + timeout * 1000 }, signal };
}

/** Cancels call when signal (an AbortSignal, or undefined) aborts, until the call ends. */
function onAbort(signal, call, cancel) {
  if (signal === undefined) return;
  if (signal.aborted) {
    cancel();
    return;
  }
  signal.addEventListener('abort', cancel, { once: true });
  call.on('status', () => signal.removeEventListener('abort', cancel));
}

/** Client of one server. `credentials`: grpc.credentials.createSsl(...) for TLS; plaintext by default. */
class Client {
  constructor(address, { apiKey = null, credentials = grpc.credentials.createInsecure() } = {}) {
    this.stub = new Generation(address, credentials);
    this.metadata = new grpc.Metadata();
    if (apiKey) this.metadata.set('authorization', `Bearer ${apiKey}`);
    this.calls = new Set(); // in flight, for close()
  }

  /** Starts a generation; options are those of buildRequest, and callOptionsOf's timeout and signal. */
  generate({ timeout, signal, ...options }) {
    const call = callOptionsOf({ timeout, signal });
    const grpcCall = this.track(this.stub.generate(buildRequest(options), this.metadata, call.options));
    const stream = new GenerateStream(grpcCall);
    onAbort(call.signal, grpcCall, () => stream.cancel());
    return stream;
  }

  /**
   * Token ids (and the text of each) of exactly one of `text` and chat `messages` (rendered with the
   * chat template, with chatInput's options); callOptionsOf's timeout and signal.
   */
  tokenize({ text, messages, timeout, signal, ...chatOptions } = {}) {
    checkOneInput({ text, messages }, chatOptions);
    const request = messages === undefined ? { text } : { chat: chatInput(messages, chatOptions) };
    return this.unary('tokenize', checked(definition['twinplane.v1.TokenizeRequest'].type, request, 'request'),
      { timeout, signal });
  }

  /** The served model and the limits that requests must respect; callOptionsOf's timeout and signal. */
  modelInfo({ timeout, signal } = {}) {
    return this.unary('getModelInfo', {}, { timeout, signal });
  }

  unary(method, request, callOptions) {
    const { options, signal } = callOptionsOf(callOptions);
    return new Promise((resolve, reject) => {
      const call = this.track(this.stub[method](request, this.metadata, options,
        (error, reply) => (error ? reject(error) : resolve(reply))));
      onAbort(signal, call, () => call.cancel());
    });
  }

  /** Keeps a call in this.calls until it ends. */
  track(call) {
    this.calls.add(call);
    call.on('status', () => this.calls.delete(call));
    return call;
  }

  /** Cancels the calls in flight (they end with CANCELLED) and closes the channel. */
  close() {
    for (const call of this.calls) call.cancel();
    this.stub.close();
  }
}

module.exports = { Client, GenerateStream, buildRequest, status: grpc.status, PROTO_PATH };
