// TypeScript declarations of twinplane.js, the Node.js client of twinplane.v1.Generation.
// Field names are the proto's in camelCase; proto/generation.proto documents each field's meaning and
// range. tests/test_node_client.py checks that these name every field the proto has.

import type { ChannelCredentials, ServiceError, status as grpcStatus } from '@grpc/grpc-js';

/** A 64-bit integer: a number (up to 2^53), a BigInt or a decimal string. */
export type Int64 = number | bigint | string;

export interface ToolCall {
  id?: string;
  name?: string;
  /** The arguments as JSON text. */
  arguments?: string;
}

/** A chat message, as replies and the proto hold it. */
export interface ChatMessage {
  role: string;
  content?: string;
  toolCalls?: ToolCall[];
  toolCallId?: string;
  name?: string;
  reasoningContent?: string;
}

/** A chat message to send: it needs content, unless it makes tool calls. */
export type SentMessage = ChatMessage & ({ content: string } | { toolCalls: ToolCall[] });

/** A function the model may call: the OpenAI API's `{ type: 'function', function }`, or the function alone. */
export interface FunctionTool {
  name: string;
  description?: string;
  /** A JSON schema of the arguments, as an object or as JSON text. */
  parameters?: object | string;
}
export type Tool = FunctionTool | { type: 'function'; function: FunctionTool };

export type JsonValue = null | boolean | number | string | JsonValue[] | { [key: string]: JsonValue };

/** Options of chat messages (given with `messages` only). */
export interface ChatOptions {
  addGenerationPrompt?: boolean;
  continueFinalMessage?: boolean;
  /** Variables of the chat template, e.g. `{ enable_thinking: false }`. */
  chatTemplateKwargs?: { [key: string]: JsonValue };
  tools?: Tool[];
  /** `'required'`, or a tool's name, forces calls. */
  toolChoice?: string;
}

/** Exactly one of the fields of T. */
type OneOf<T> = { [K in keyof T]: Pick<T, K> & { [Other in Exclude<keyof T, K>]?: never } }[keyof T];

/** Structured output: exactly one kind. */
export type StructuredOutput = OneOf<{
  jsonSchema: string;
  jsonObject: boolean;
  regex: string;
  choice: { choices: string[] };
}>;

/** The fields of SamplingParams. */
export interface SamplingOptions {
  temperature?: number;
  topP?: number;
  topK?: number;
  minP?: number;
  repetitionPenalty?: number;
  presencePenalty?: number;
  frequencyPenalty?: number;
  seed?: Int64;
}

/** The fields of GenerateRequest other than its input and sampling. */
export interface RequestOptions {
  requestId?: string;
  maxTokens?: number;
  minTokens?: number;
  /** One stop string, or several. */
  stop?: string | string[];
  stopTokenIds?: number[];
  ignoreEos?: boolean;
  logprobs?: number;
  truncatePromptTokens?: number;
  skipSpecialTokens?: boolean;
  /** Token id to bias. */
  logitBias?: { [tokenId: number]: number };
  includeStopStrInOutput?: boolean;
  priority?: number;
  parseOutput?: boolean;
  structuredOutput?: StructuredOutput;
  promptLogprobs?: number;
  allowedTokenIds?: number[];
  badWords?: string[];
}

/** Per call: `timeout` in seconds (DEADLINE_EXCEEDED after it), `signal` cancels the call. */
export interface CallOptions {
  timeout?: number;
  signal?: AbortSignal;
}

/** A chat message as an object or as a [role, content] pair. */
export type Message = SentMessage | [string, string];

/** The prompt: exactly one of text, token ids or chat messages (with their options). */
export type Input =
  | ({ prompt: string; tokenIds?: never; messages?: never } & NoChatOptions)
  | ({ tokenIds: number[]; prompt?: never; messages?: never } & NoChatOptions)
  | ({ messages: Message[]; prompt?: never; tokenIds?: never } & ChatOptions);

type NoChatOptions = { [K in keyof ChatOptions]?: never };

/** A value left null or undefined takes the server's default. */
type Unset<T> = { [K in keyof T]?: T[K] | null };

/** What a GenerateRequest is built from: the input, and any field of SamplingParams or GenerateRequest. */
export type RequestFields = Input & Unset<SamplingOptions> & Unset<RequestOptions>;

export type GenerateOptions = RequestFields & CallOptions;

export type TokenizeOptions =
  | ({ text: string; messages?: never } & NoChatOptions & CallOptions)
  | ({ messages: Message[]; text?: never } & ChatOptions & CallOptions);

export interface TokenLogprob {
  tokenId: number;
  logprob: number;
  /** 1 for the most likely token; absent where not computed. */
  rank?: number;
}

export interface PositionLogprobs {
  sampled: TokenLogprob | null;
  top: TokenLogprob[];
}

export interface ToolCallDelta {
  index: number;
  id: string;
  name: string;
  arguments: string;
}

export interface Usage {
  promptTokens: number;
  completionTokens: number;
  cachedPromptTokens: number;
}

/** null while the stream runs; 'unknown' for a reason newer than this copy of the proto. */
export type FinishReason = 'stop_token' | 'stop_string' | 'length' | 'aborted' | 'unknown' | null;

/** One GenerateResponse. */
export interface Chunk {
  requestId: string;
  tokenIds: number[];
  text: string;
  logprobs: PositionLogprobs[];
  finishReason: FinishReason;
  /** On the last chunk only. */
  usage: Usage | null;
  matchedStop: string;
  reasoningText: string;
  toolCalls: Required<ToolCall>[];
  toolCallDeltas: ToolCallDelta[];
  promptLogprobs: PositionLogprobs[];
}

export interface TokenizeResult {
  tokenIds: number[];
  tokens: string[];
}

export interface ModelInfo {
  model: string;
  architecture: string;
  vocabSize: number;
  maxModelLen: number;
  dtype: string;
  blockSize: number;
  numKvBlocks: number;
  tensorParallelSize: number;
  attentionBackend: string;
  eosTokenIds: number[];
  maxLogprobs: number;
  hasChatTemplate: boolean;
  weightBytes: number;
  kvBytesPerToken: number;
  device: string;
  dataParallelSize: number;
  maxNumSeqs: number;
  maxNumBatchedTokens: number;
  hiddenSize: number;
  numHiddenLayers: number;
  numAttentionHeads: number;
  headDim: number;
  layerParams: number;
  reasoningParser: string;
  toolCallParser: string;
  kvCacheDtype: string;
  /** What the fields a request leaves unset get (null from a server older than the field). */
  generationDefaults: GenerationDefaults | null;
}

/** The server's defaults, from the model's generation config; a field left out keeps the built-in default. */
export interface GenerationDefaults {
  temperature?: number;
  topP?: number;
  topK?: number;
  minP?: number;
  repetitionPenalty?: number;
  maxTokens?: number;
}

/** A running Generate call: iterate it once; `final` is the last chunk once the stream has ended. */
export class GenerateStream implements AsyncIterable<Chunk> {
  readonly cancelled: boolean;
  readonly final: Chunk | null;
  [Symbol.asyncIterator](): AsyncIterator<Chunk>;
  /** Aborts the request (the server frees its KV cache at once). */
  cancel(): void;
  /** Consumes the stream and returns all of its text. */
  text(): Promise<string>;
}

export interface ClientOptions {
  apiKey?: string | null;
  /** grpc.credentials.createSsl(...) for TLS; plaintext by default. */
  credentials?: ChannelCredentials;
}

/** Client of one server. A failed call throws (or rejects with) grpc-js's ServiceError. */
export class Client {
  constructor(address: string, options?: ClientOptions);
  generate(options: GenerateOptions): GenerateStream;
  tokenize(options: TokenizeOptions): Promise<TokenizeResult>;
  modelInfo(options?: CallOptions): Promise<ModelInfo>;
  /** Cancels the calls in flight (they end with CANCELLED) and closes the channel. */
  close(): void;
}

/** The GenerateRequest that `generate` sends for these options (without the call options). */
export function buildRequest(options: RequestFields): object;

export const status: typeof grpcStatus;
export const PROTO_PATH: string;
export type { ServiceError };
