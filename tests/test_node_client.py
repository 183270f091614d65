"""The Node.js client (clients/node) against both planes on loopback: the same output as the Python client.

Needs node and the client's npm packages (`npm ci --prefix clients/node`, done by .ci/run); without
them the tests skip, except under CI=true, where they fail.
"""

from __future__ import annotations

import json
import re
import select
import signal
import subprocess

import grpc
import pytest

from tests.conftest import NODE_CLIENT
from tests.reliability import all_blocks_free, wait_until

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


# prints the chunks of one generate call as JSON; argv: module, address, the options as JSON
CHUNKS_SCRIPT = """
const { Client } = require(process.argv[1]);
(async () => {
  const client = new Client(process.argv[2]);
  const chunks = [];
  for await (const chunk of client.generate(JSON.parse(process.argv[3]))) chunks.push(chunk);
  client.close();
  console.log(JSON.stringify(chunks));
})();
"""


def node_chunks(node: str, address: str, options: dict) -> list[dict]:
    result = subprocess.run([node, "-e", CHUNKS_SCRIPT, str(NODE_CLIENT / "twinplane.js"), address,
                             json.dumps(options)], capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


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
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL) as proc:
        try:
            assert select.select([proc.stdout], [], [], 60)[0], "no text streamed within 60 s"
            assert loopback_planes.engine.requests  # still generating
            proc.send_signal(signal.SIGINT)
            stdout, stderr = proc.communicate(timeout=30)
        finally:
            proc.kill()
    assert proc.returncode == 130, stderr
    assert b"[cancelled]" in stderr and stdout
    wait_until(lambda: all_blocks_free(loopback_planes), 10, "the cancelled request's blocks to be freed")
