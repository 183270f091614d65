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
 * nothing is generated. Field names are camelCase (max_tokens is maxTokens), enums are strings
 * and 64-bit integers are numbers. A failed call rejects (or throws from the iteration) with
 * grpc-js's ServiceError: `code` (a grpc.status value), `details` (the server's message).
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
  const { addGenerationPrompt, continueFinalMessage, chatTemplateKwargs, tools, toolChoice } = options;
  const chat = { messages: messages.map((m) => (Array.isArray(m) ? { role: m[0], content: m[1] } : m)) };
  if (addGenerationPrompt !== undefined) chat.addGenerationPrompt = addGenerationPrompt;
  if (continueFinalMessage !== undefined) chat.continueFinalMessage = continueFinalMessage;
  if (chatTemplateKwargs !== undefined) chat.chatTemplateKwargs = structOf(chatTemplateKwargs);
  if (tools !== undefined) chat.tools = tools.map(toolOf);
  if (toolChoice !== undefined) chat.toolChoice = toolChoice;
  return chat;
}

/** The prompt of a request: exactly one of `prompt` (text), `tokenIds` or `messages` (chat, with its options). */
function inputOf({ prompt, tokenIds, messages, ...chatOptions }) {
  const given = [prompt, tokenIds, messages].filter((value) => value !== undefined);
  if (given.length !== 1) throw new TypeError('give exactly one of prompt, tokenIds or messages');
  if (messages === undefined && Object.values(chatOptions).some((value) => value !== undefined)) {
    throw new TypeError('addGenerationPrompt, continueFinalMessage, chatTemplateKwargs, tools and toolChoice go with '
      + 'messages');
  }
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
    else if (REQUEST_FIELDS.has(key)) request[key] = value;
    else throw new TypeError(`unknown option ${key}`);
  }
  return request;
}

/** 'FINISH_REASON_STOP_TOKEN' -> 'stop_token'; null while the stream runs. */
function finishReasonOf(name) {
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

/** Client of one server. `credentials`: grpc.credentials.createSsl(...) for TLS; plaintext by default. */
class Client {
  constructor(address, { apiKey = null, credentials = grpc.credentials.createInsecure() } = {}) {
    this.stub = new Generation(address, credentials);
    this.metadata = new grpc.Metadata();
    if (apiKey) this.metadata.set('authorization', `Bearer ${apiKey}`);
  }

  /** Starts a generation; options are those of buildRequest. */
  generate(options) {
    return new GenerateStream(this.stub.generate(buildRequest(options), this.metadata));
  }

  /**
   * Token ids (and the text of each) of `text`, or of chat `messages` rendered with the chat
   * template (with chatInput's options).
   */
  tokenize({ text, messages, ...chatOptions }) {
    const request = messages === undefined ? { text } : { chat: chatInput(messages, chatOptions) };
    return this.unary('tokenize', request);
  }

  /** The served model and the limits that requests must respect. */
  modelInfo() {
    return this.unary('getModelInfo', {});
  }

  unary(method, request) {
    return new Promise((resolve, reject) => {
      this.stub[method](request, this.metadata, (error, reply) => (error ? reject(error) : resolve(reply)));
    });
  }

  /** Closes the channel; calls in flight are cancelled. */
  close() {
    this.stub.close();
  }
}

module.exports = { Client, GenerateStream, buildRequest, status: grpc.status, PROTO_PATH };
