"""The Node.js client (clients/node) against both planes on loopback: the same output as the Python client.

Needs node and the client's npm packages (`npm ci --prefix clients/node`, done by .ci/run); without
them the tests skip, except under CI=true, where they fail.
"""

from __future__ import annotations

import json
import re
import subprocess
import threading

import grpc
import pytest

from tests.conftest import NODE_CLIENT
from tests.reliability import DRAIN_LONG, all_blocks_free, interrupt_mid_stream, wait_until

SUMMARY = re.compile(r"^\[(\w+); prompt (\d+) tokens, completion (\d+), cached (\d+)\]$", re.M)
PROMPT = "The quick brown fox"

# prints the replies of Tokenize (text, chat, and chat left open with options) and GetModelInfo as JSON;
# argv: module, address
INFO_SCRIPT = """
const { Client } = require(process.argv[1]);
(async () => {
  const client = new Client(process.argv[2]);
  const text = await client.tokenize({ text: 'Hello world' });
  const chat = await client.tokenize({ messages: [['user', 'Hi!']] });
  const open = await client.tokenize({
    messages: [['user', 'Hi!'], ['assistant', 'Hello, I']], addGenerationPrompt: false, continueFinalMessage: true,
    chatTemplateKwargs: { enable_thinking: false, n: [2] },
  });
  const info = await client.modelInfo();
  client.close();
  console.log(JSON.stringify({ text, chat, open, info }));
})();
"""




def generate_js(node: str, address: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([node, str(NODE_CLIENT / "generate.js"), "--server", address, *args],
                          capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("chat", [False, True], ids=["text", "chat"])
def test_node_streams_the_same_greedy_text_as_the_python_client(node, loopback_planes, chat):
    prompt = {"messages": [{"role": "user", "content": PROMPT}]} if chat else {"prompt": PROMPT}
    with loopback_planes.client() as client:
        chunks = list(client.generate(**prompt, max_tokens=24, temperature=0))
    expected, final = "".join(c.text for c in chunks), chunks[-1]
    assert expected and final.finish_reason in ("length", "stop_token")

    result = generate_js(node, loopback_planes.address, "--max-tokens", "24", "--temperature", "0",
                         *(["--chat"] if chat else []), PROMPT)
    assert result.returncode == 0, result.stderr
    assert result.stdout == expected + "\n"
    reason, prompt_tokens, completion_tokens, cached = SUMMARY.search(result.stderr).groups()
    assert (reason, int(prompt_tokens), int(completion_tokens)) == (
        final.finish_reason, final.usage.prompt_tokens, final.usage.completion_tokens)
    assert int(cached) <= int(prompt_tokens)


# prints the chunks of one generate call as they come, one JSON line each; argv: module, address, the options as JSON
CHUNKS_SCRIPT = """
const { Client } = require(process.argv[1]);
(async () => {
  const client = new Client(process.argv[2]);
  for await (const chunk of client.generate(JSON.parse(process.argv[3]))) console.log(JSON.stringify(chunk));
  client.close();
})();
"""


def node_chunks(node: str, address: str, options: dict, on_chunk=lambda chunk: None) -> list[dict]:
    """The chunks of one generate call through the Node.js client, each given to on_chunk as it comes."""
    with subprocess.Popen([node, "-e", CHUNKS_SCRIPT, str(NODE_CLIENT / "twinplane.js"), address, json.dumps(options)],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True) as run:
        timer = threading.Timer(60, run.kill)
        timer.start()
        try:
            chunks = []
            for line in run.stdout:
                chunks.append(json.loads(line))
                on_chunk(chunks[-1])
            stderr = run.stderr.read()
        finally:
            timer.cancel()
    assert run.returncode == 0, stderr
    return chunks


def test_node_chunks_carry_the_log_probabilities_and_the_prompts(node, loopback_planes):
    """logprobs and promptLogprobs through the Node.js client: the Python client's tokens, log-probabilities,
    top tokens and the prompt tokens' ranks."""
    prompt = list(range(300, 320))
    with loopback_planes.client() as client:
        chunks = list(client.generate(token_ids=prompt, max_tokens=4, temperature=0, logprobs=2, prompt_logprobs=3))
    got = node_chunks(node, loopback_planes.address, {"tokenIds": prompt, "maxTokens": 4, "temperature": 0,
                                                      "logprobs": 2, "promptLogprobs": 3})
    assert [t for c in got for t in c["tokenIds"]] == [t for c in chunks for t in c.token_ids]
    mine = [p for c in got for p in c["logprobs"]]
    theirs = [p for c in chunks for p in c.logprobs]
    assert [p["sampled"]["tokenId"] for p in mine] == [p.token_id for p in theirs]
    assert [p["sampled"]["logprob"] for p in mine] == pytest.approx([p.logprob for p in theirs], abs=1e-5)
    assert [[t["tokenId"] for t in p["top"]] for p in mine] == [[t for t, _ in p.top] for p in theirs]
    scored, expected = got[0]["promptLogprobs"], chunks[0].prompt_logprobs
    assert [p["sampled"]["tokenId"] for p in scored] == prompt[1:] == [p.token_id for p in expected]
    assert [p["sampled"]["rank"] for p in scored] == [p.rank for p in expected] and all(p.rank for p in expected)
    assert [[t["tokenId"] for t in p["top"]] for p in scored] == [[t for t, _ in p.top] for p in expected]
    assert not any(c["promptLogprobs"] for c in got[1:]), "the first chunk only"


def test_node_surfaces_the_status_code_and_message_of_a_bad_request(node, loopback_planes):
    with loopback_planes.client() as client:
        with pytest.raises(grpc.RpcError) as info:
            client.generate(PROMPT, max_tokens=100_000).text()
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_tokens" in info.value.details()

    result = generate_js(node, loopback_planes.address, "--max-tokens", "100000", PROMPT)
    assert result.returncode == 1
    assert f"error: INVALID_ARGUMENT: {info.value.details()}" in result.stderr
    assert result.stdout == ""


def test_node_tokenize_and_model_info_match_the_python_client(node, loopback_planes):
    result = subprocess.run([node, "-e", INFO_SCRIPT, str(NODE_CLIENT / "twinplane.js"), loopback_planes.address],
                            capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stderr
    replies = json.loads(result.stdout)
    with loopback_planes.client() as client:
        assert replies["text"]["tokenIds"] == client.tokenize("Hello world")
        assert replies["chat"]["tokenIds"] == client.tokenize(messages=[("user", "Hi!")])
        begun = [("user", "Hi!"), ("assistant", "Hello, I")]
        open_turn = client.tokenize(messages=begun, add_generation_prompt=False, continue_final_message=True,
                                    chat_template_kwargs={"enable_thinking": False, "n": [2]})
        assert replies["open"]["tokenIds"] == open_turn != client.tokenize(messages=begun)
        model = client.model_info()
    assert len(replies["text"]["tokens"]) == len(replies["text"]["tokenIds"])
    info = replies["info"]
    assert (info["vocabSize"], info["maxModelLen"], info["architecture"], info["eosTokenIds"]) == (
        model.vocab_size, model.max_model_len, model.architecture, model.eos_token_ids)


def test_ctrl_c_cancels_the_request_and_frees_its_blocks(node, loopback_planes):
    command = [node, str(NODE_CLIENT / "generate.js"), "--server", loopback_planes.address,
               "--max-tokens", "3000", "--ignore-eos", PROMPT]
    returncode, stdout, stderr = interrupt_mid_stream(command, loopback_planes)
    assert returncode == 130, stderr
    assert b"[cancelled]" in stderr and stdout


# tries buildRequest (or Client.tokenize, offline) on each case and prints what came out, as JSON:
# {"ok": the request} or {"error": the TypeError's message}; argv: module, the cases as JSON
BUILD_SCRIPT = """
const { Client, buildRequest } = require(process.argv[1]);
const client = new Client('127.0.0.1:1');
const outcome = (build) => {
  try { return { ok: build() }; } catch (error) { return { error: `${error.constructor.name}: ${error.message}` }; }
};
const results = JSON.parse(process.argv[2]).map(([what, options]) => outcome(() => (what === 'tokenize'
  ? (client.tokenize(options).catch(() => {}), 'sent') : buildRequest(options))));
results.push(outcome(() => buildRequest({ prompt: 'x', seed: 2n ** 64n - 1n })));
client.close();
console.log(JSON.stringify(results));
"""


def test_node_refuses_what_the_proto_cannot_hold_before_sending_it(node):
    """Numbers past their field's range, fractions, keys a message does not have (at any depth) and
    malformed inputs are a TypeError naming the field, never a request the encoder wraps or drops."""
    refused = [
        ({"prompt": "x", "maxTokens": 2**32 + 2}, "request.maxTokens must be an integer in [0, 4294967295]"),
        ({"prompt": "x", "maxTokens": 1.7}, "request.maxTokens must be an integer"),
        ({"prompt": "x", "maxTokens": -1}, "got -1"),
        ({"prompt": "x", "maxTokens": "abc"}, "got 'abc'"),
        ({"prompt": "x", "topK": 2**31}, "request.sampling.topK must be an integer in [-2147483648, 2147483647]"),
        ({"prompt": "x", "seed": -1}, "request.sampling.seed must be an integer in [0, 18446744073709551615]"),
        ({"prompt": "x", "temperature": "hot"}, "request.sampling.temperature must be a finite number"),
        ({"tokenIds": [-1]}, "request.tokenIds.ids[0] must be an integer"),
        ({"prompt": "x", "stop": [3]}, "request.stop[0] must be a string"),
        ({"prompt": "x", "logitBias": {"5": "up"}}, "request.logitBias[5] must be a finite number"),
        ({"messages": [{"role": "tool", "content": "20C", "tool_call_id": "c1"}]},
         "request.chat.messages[0] has no field tool_call_id; its fields: role, content, toolCalls, toolCallId"),
        ({"prompt": "x", "structuredOutput": {"json_schema": "{}"}},
         "request.structuredOutput has no field json_schema"),
        ({"messages": [{"role": "user"}]}, "messages[0] needs a role and content"),
        ({"prompt": "x", "temperature": 1e40}, "request.sampling.temperature must be a finite number (32-bit)"),
        ({"prompt": "x", "logitBias": {"": 1.5}}, "request.logitBias key  must be an integer"),
        ({"prompt": "x", "logitBias": {"0x10": 1.5}}, "request.logitBias key 0x10 must be an integer"),
        ({"prompt": "x", "structuredOutput": {"jsonObject": True, "regex": "a+"}},
         "structuredOutput takes one of jsonSchema, jsonObject, regex and choice, got jsonObject, regex"),
    ]
    sent = [
        {"prompt": "x", "stop": ","},
        {"prompt": "x", "seed": "18446744073709551615", "maxTokens": 4294967295, "topK": -1},
        {"messages": [{"role": "assistant", "toolCalls": [{"id": "c1", "name": "f", "arguments": "{}"}]},
                      {"role": "tool", "content": "20C", "toolCallId": "c1"}]},
    ]
    tokenize_refused = [({"text": "a", "messages": [["user", "b"]]}, "give exactly one of text or messages"),
                        ({}, "give exactly one of text or messages"),
                        ({"text": "a", "chatTemplateKwargs": {"x": 1}}, "given without messages"),
                        ({"messages": [["user", "b"]], "addGenerationPromt": False},
                         "unknown option addGenerationPromt")]
    cases = [["generate", o] for o, _ in refused] + [["generate", o] for o in sent] + [
        ["tokenize", o] for o, _ in tokenize_refused]
    result = subprocess.run([node, "-e", BUILD_SCRIPT, str(NODE_CLIENT / "twinplane.js"), json.dumps(cases)],
                            capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stderr
    outcomes = json.loads(result.stdout)
    expected = [message for _, message in refused] + [None] * len(sent) + [m for _, m in tokenize_refused]
    for (what, options), want, got in zip(cases, expected, outcomes):
        if want is None:
            assert "ok" in got, (options, got)
        else:
            assert got.get("error", "").startswith("TypeError: ") and want in got["error"], (options, got)
    stop, wide, calls = (o["ok"] for o in outcomes[len(refused):len(refused) + len(sent)])
    assert stop["stop"] == [","]
    assert wide["sampling"]["seed"] == "18446744073709551615" and wide["maxTokens"] == 4294967295
    assert calls["chat"]["messages"][1]["toolCallId"] == "c1"
    assert outcomes[-1] == {"ok": {"text": "x", "sampling": {"seed": str(2**64 - 1)}}}  # a BigInt seed


# starts a long generation, then (argv[3]) closes the client, aborts its signal or lets its timeout pass;
# prints how the stream ended as JSON; argv: module, address, how, max tokens
END_SCRIPT = """
const { Client } = require(process.argv[1]);
(async () => {
  const client = new Client(process.argv[2]);
  const how = process.argv[3];
  const controller = new AbortController();
  const stream = client.generate({ prompt: 'The quick brown fox', maxTokens: Number(process.argv[4]), ignoreEos: true,
    ...(how === 'timeout' ? { timeout: 4 } : {}), ...(how === 'signal' ? { signal: controller.signal } : {}) });
  let chunks = 0;
  let code = null;
  try {
    for await (const chunk of stream) {
      chunks += 1;
      if (chunks === 1 && how === 'close') client.close();
      if (chunks === 1 && how === 'signal') controller.abort();
    }
  } catch (error) {
    code = error.code;
  }
  const aborted = new AbortController();
  aborted.abort();
  const other = new Client(process.argv[2]);
  const unary = await other.modelInfo({ signal: aborted.signal }).then(() => null, (error) => error.code);
  const shared = new AbortController(); // one long-lived signal for many calls: each call's listener goes with it
  for (let i = 0; i < 3; i += 1) await other.modelInfo({ signal: shared.signal });
  const { getEventListeners } = require('node:events');
  other.close();
  client.close();
  console.log(JSON.stringify({ chunks, code, final: stream.final, unary,
    listeners: getEventListeners(shared.signal, 'abort').length }));
})();
"""


@pytest.mark.parametrize("how, code", [("close", grpc.StatusCode.CANCELLED), ("signal", None),
                                       ("timeout", grpc.StatusCode.DEADLINE_EXCEEDED)])
def test_node_close_signal_and_timeout_end_the_call_on_the_server(node, drain_planes, how, code):
    """close() cancels the calls in flight, an aborted signal cancels its call (a stream then ends
    quietly), a timeout ends it with DEADLINE_EXCEEDED; the server frees the request's blocks each time.
    The stream cannot end within the timeout on any machine (drain_planes: each token reads all the weights);
    the tiny model's 3,000 tokens took 5 s on an idle 2-core machine, 1 s on one five times as fast."""
    result = subprocess.run([node, "-e", END_SCRIPT, str(NODE_CLIENT / "twinplane.js"), drain_planes.address, how,
                             str(DRAIN_LONG)], capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stderr
    ended = json.loads(result.stdout)
    assert ended["code"] == (code.value[0] if code else None), ended
    assert ended["final"] is None and 0 < ended["chunks"] < DRAIN_LONG, ended
    assert ended["unary"] == grpc.StatusCode.CANCELLED.value[0]  # a signal aborted before the call
    assert ended["listeners"] == 0  # calls that ended left nothing on the signal they were given
    wait_until(lambda: all_blocks_free(drain_planes), 10, "the ended request's blocks to be freed")


# A program that uses every part of the client, which the declarations must type without an error.
TYPED_PROGRAM = """
import * as grpc from '@grpc/grpc-js';
import { Chunk, Client, ModelInfo, PositionLogprobs, TokenizeResult, buildRequest, status } from 'twinplane';

async function main(): Promise<void> {
  const client = new Client('127.0.0.1:1', { apiKey: 'key', credentials: grpc.credentials.createInsecure() });
  const stream = client.generate({
    messages: [{ role: 'user', content: 'Hi' }, ['assistant', 'Hello'], { role: 'assistant', toolCalls: [
      { id: 'c1', name: 'f', arguments: '{}' }] }, { role: 'tool', content: '1', toolCallId: 'c1' }],
    addGenerationPrompt: true, chatTemplateKwargs: { enable_thinking: false, n: [1, 'a', null] },
    tools: [{ type: 'function', function: { name: 'f', parameters: { type: 'object' } } }, { name: 'g' }],
    toolChoice: 'required', maxTokens: 8, minTokens: null, temperature: 0, topP: 0.9, topK: 5, seed: 2n ** 63n,
    stop: 'x', stopTokenIds: [2], logitBias: { 5: -100 }, logprobs: 2, promptLogprobs: 1, parseOutput: true,
    structuredOutput: { choice: { choices: ['a', 'b'] } }, priority: 1, requestId: 'r', timeout: 5,
    signal: new AbortController().signal,
  });
  for await (const chunk of stream) {
    const top: PositionLogprobs[] = chunk.logprobs;
    const rank: number | undefined = top[0]?.sampled?.rank;
    process.stdout.write(chunk.text + chunk.tokenIds.length + (rank ?? 0) + chunk.toolCallDeltas.length);
  }
  const last: Chunk | null = stream.final;
  const reason: string | null = last?.finishReason ?? null;
  const used: number = last?.usage?.completionTokens ?? 0;
  const text: string = await client.generate({ tokenIds: [1, 2], ignoreEos: true }).text();
  const tokens: TokenizeResult = await client.tokenize({ messages: [['user', 'Hi']], continueFinalMessage: true });
  const info: ModelInfo = await client.modelInfo({ timeout: 1 });
  buildRequest({ prompt: 'x', structuredOutput: { jsonSchema: '{}' }, seed: '18446744073709551615' });
  console.log(reason, used, text, tokens.tokenIds[0], info.maxModelLen + info.eosTokenIds[0], status.CANCELLED);
  client.close();
}
main();
"""

# Mistakes the declarations must refuse, one a line.
MISTYPED_LINES = """
client.generate({ prompt: 'x', maxTokenz: 3 });
client.generate({ prompt: 'x', temperature: 'hot' });
client.generate({ prompt: 'x', tokenIds: [1] });
client.generate({ maxTokens: 3 });
client.generate({ prompt: 'x', tools: [] });
client.generate({ prompt: 'x', structuredOutput: { regex: 'a+', jsonObject: true } });
client.generate({ prompt: 'x', seed: true });
client.generate({ messages: [{ content: 'no role' }] });
client.tokenize({ text: 'x', addGenerationPrompt: true });
client.modelInfo({ timeout: '1' });
const reason: 'stop' = client.generate({ prompt: 'x' }).final!.finishReason;
buildRequest({});
buildRequest({ prompt: 'x', tokenIds: [1] });
buildRequest({ prompt: 'x', timeout: 1 });
client.generate({ messages: [{ role: 'user' }] });
""".strip().splitlines()


def _tsc(node: str, tmp_path, name: str, source: str) -> subprocess.CompletedProcess:
    """Type-checks source (strict) against clients/node's declarations; 'twinplane' names the client."""
    (tmp_path / f"{name}.ts").write_text(source)
    modules = NODE_CLIENT / "node_modules"
    (tmp_path / "tsconfig.json").write_text(json.dumps({
        "compilerOptions": {"strict": True, "noEmit": True, "target": "es2022", "module": "commonjs",
                            "moduleResolution": "node", "types": ["node"], "typeRoots": [str(modules / "@types")],
                            "baseUrl": str(modules), "paths": {"twinplane": [str(NODE_CLIENT / "twinplane")]}},
        "files": [f"{name}.ts"]}))
    return subprocess.run([node, str(modules / "typescript" / "bin" / "tsc"), "-p", str(tmp_path)],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)


def test_typescript_declarations_type_a_whole_program_and_refuse_each_mistake(node, tmp_path):
    typed = _tsc(node, tmp_path, "typed", TYPED_PROGRAM)
    assert typed.returncode == 0, typed.stdout + typed.stderr
    header = "import { Client, buildRequest } from 'twinplane';\nconst client = new Client('127.0.0.1:1');\n"
    mistyped = _tsc(node, tmp_path, "mistyped", header + "\n".join(MISTYPED_LINES) + "\n")
    lines = {int(line) - 3 for line in re.findall(r"^mistyped\.ts\((\d+),\d+\): error", mistyped.stdout, re.M)}
    assert lines == set(range(len(MISTYPED_LINES))), mistyped.stdout


def _declared(interface: str) -> set[str]:
    """The property names of an interface in twinplane.d.ts."""
    source = (NODE_CLIENT / "twinplane.d.ts").read_text()
    body = re.search(rf"^export interface {interface} {{\n(.*?)^}}", source, re.M | re.S).group(1)
    return set(re.findall(r"^  (\w+)\??:", body, re.M))


def test_typescript_declarations_name_every_field_of_the_proto():
    from twinplane.proto import generation_pb2 as pb

    def fields(message, *leave_out: str) -> set[str]:
        return {f.camelcase_name for f in message.DESCRIPTOR.fields if f.name not in leave_out}

    assert _declared("SamplingOptions") == fields(pb.SamplingParams)
    assert _declared("RequestOptions") == fields(pb.GenerateRequest, "text", "token_ids", "chat", "sampling")
    assert _declared("ChatOptions") == fields(pb.ChatInput, "messages")
    for interface, message in [("Chunk", pb.GenerateResponse), ("ModelInfo", pb.ModelInfo), ("Usage", pb.Usage),
                               ("ChatMessage", pb.ChatMessage), ("ToolCall", pb.ToolCall),
                               ("ToolCallDelta", pb.ToolCallDelta), ("TokenLogprob", pb.TokenLogprob),
                               ("PositionLogprobs", pb.PositionLogprobs), ("TokenizeResult", pb.TokenizeResponse)]:
        assert _declared(interface) == fields(message), interface
