#!/usr/bin/env node
'use strict';
/**
 * Streams a completion from a twinplane server to stdout, then prints the finish reason and
 * token usage to stderr (the same output as `twinplane generate`).
 *
 *     node generate.js --server 127.0.0.1:50051 --max-tokens 64 --chat "What is the capital of France?"
 *
 * Exit codes: 0 done, 1 the call failed (the gRPC status and the server's message are printed),
 * 2 bad arguments, 130 interrupted (Ctrl-C cancels the request on the server).
 */

const { parseArgs } = require('node:util');
const { Client, buildRequest, status } = require('./twinplane');

const USAGE = `usage: generate.js [--server HOST:PORT] [--chat] [--max-tokens N] [--temperature T]
                   [--top-p P] [--top-k K] [--seed S] [--ignore-eos] [--api-key KEY] PROMPT`;

const OPTIONS = {
  server: { type: 'string', default: '127.0.0.1:50051' },
  chat: { type: 'boolean', default: false },
  'max-tokens': { type: 'string', default: '256' },
  temperature: { type: 'string', default: '0' }, // greedy unless told otherwise
  'top-p': { type: 'string' },
  'top-k': { type: 'string' },
  seed: { type: 'string' },
  'ignore-eos': { type: 'boolean', default: false },
  'api-key': { type: 'string' },
  help: { type: 'boolean', default: false },
};

class UsageError extends Error {}

/** A numeric option as a number (undefined when not given); --seed, a 64-bit integer, stays decimal text. */
function number(values, name) {
  const text = values[name];
  if (text === undefined) return undefined;
  const value = Number(text);
  if (text.trim() === '' || Number.isNaN(value)) throw new UsageError(`--${name} must be a number, got '${text}'`);
  return name === 'seed' ? text.trim() : value;
}

/** The request's options by the flags that set them, for the checks' messages. */
const FLAGS = { maxTokens: '--max-tokens', temperature: '--temperature', topP: '--top-p', topK: '--top-k',
  seed: '--seed' };

/** The request, checked as the client checks it (a value its field cannot hold is a UsageError). */
function checkedRequest(request) {
  try {
    buildRequest(request);
  } catch (error) {
    if (!(error instanceof TypeError)) throw error;
    throw new UsageError(error.message.replace(/^request\.(?:sampling\.)?(\w+)/, (m, name) => FLAGS[name] ?? m));
  }
  return request;
}

/** Command-line arguments as the prompt, the server address and the options of Client.generate. */
function parse(argv) {
  let parsed;
  try {
    parsed = parseArgs({ args: argv, options: OPTIONS, allowPositionals: true });
  } catch (error) {
    throw new UsageError(error.message);
  }
  const { values, positionals } = parsed;
  if (values.help) return null;
  if (positionals.length !== 1) throw new UsageError('give exactly one PROMPT');
  const prompt = positionals[0];
  return {
    server: values.server,
    apiKey: values['api-key'] || process.env.TWINPLANE_API_KEY,
    request: checkedRequest({
      ...(values.chat ? { messages: [{ role: 'user', content: prompt }] } : { prompt }),
      maxTokens: number(values, 'max-tokens'),
      temperature: number(values, 'temperature'),
      topP: number(values, 'top-p'),
      topK: number(values, 'top-k'),
      seed: number(values, 'seed'),
      ignoreEos: values['ignore-eos'],
    }),
  };
}

/** Streams the text to stdout; returns the final chunk (null when cancelled). */
async function stream(client, request) {
  const generation = client.generate(request);
  process.once('SIGINT', () => generation.cancel());
  for await (const chunk of generation) process.stdout.write(chunk.text);
  process.stdout.write('\n');
  return generation.final;
}

function summary(final) {
  if (final === null) return '[cancelled]';
  const u = final.usage;
  return `[${final.finishReason}; prompt ${u.promptTokens} tokens, completion ${u.completionTokens}, ` +
    `cached ${u.cachedPromptTokens}]`;
}

async function main(argv) {
  let args;
  try {
    args = parse(argv);
  } catch (error) {
    if (!(error instanceof UsageError)) throw error;
    console.error(`${USAGE}\nerror: ${error.message}`);
    return 2;
  }
  if (args === null) {
    console.log(USAGE);
    return 0;
  }
  const client = new Client(args.server, { apiKey: args.apiKey });
  try {
    const final = await stream(client, args.request);
    console.error(summary(final));
    return final === null ? 130 : 0;
  } catch (error) {
    if (error.code === undefined) throw error;
    console.error(`error: ${status[error.code]}: ${error.details}`);
    return 1;
  } finally {
    client.close();
  }
}

main(process.argv.slice(2)).then((code) => {
  process.exitCode = code;
});
