"""A client that knows no .proto file: it learns the API through server reflection, as grpcurl does.

The descriptors come from the server into a fresh DescriptorPool; request and response classes are
built from them (message_factory) and methods are called by name through generic channel calls.
The grpcurl commands of README.md are run this way, so the README stays true.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import grpc
from google.protobuf import descriptor_pool, json_format, message_factory
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from twinplane.proto import generation_pb2 as pb

README = Path(__file__).resolve().parents[1] / "README.md"


class ReflectionClient:
    """Lists services and calls any method by its full name with a JSON body, knowing only the server."""

    def __init__(self, channel: grpc.Channel):
        self.channel = channel
        self.database = ProtoReflectionDescriptorDatabase(channel)
        self.pool = descriptor_pool.DescriptorPool(self.database)

    def services(self) -> list[str]:
        return list(self.database.get_services())

    def method(self, name: str):
        """The descriptor of "package.Service/Method"."""
        service, method = name.split("/")
        return self.pool.FindServiceByName(service).methods_by_name[method]

    def rpc(self, method):
        """A generic callable of a method descriptor, serializing with the classes resolved from it."""
        request_class = message_factory.GetMessageClass(method.input_type)
        response_class = message_factory.GetMessageClass(method.output_type)
        kind = self.channel.unary_stream if method.server_streaming else self.channel.unary_unary
        return kind(f"/{method.containing_service.full_name}/{method.name}",
                    request_serializer=request_class.SerializeToString,
                    response_deserializer=response_class.FromString)

    def call(self, name: str, body: dict, timeout: float = 60) -> list[dict]:
        """Calls a method with a request parsed from body; returns every reply as a dict (field names as in
        the proto)."""
        method = self.method(name)
        request = json_format.ParseDict(body, message_factory.GetMessageClass(method.input_type)())
        replies = self.rpc(method)(request, timeout=timeout)
        return [json_format.MessageToDict(reply, preserving_proto_field_name=True)
                for reply in (replies if method.server_streaming else [replies])]


def readme_grpcurl_commands() -> list[list[str]]:
    """The grpcurl command lines of README.md (continuation lines joined), as argument lists."""
    text = README.read_text().replace("\\\n", " ")
    return [shlex.split(line) for line in text.splitlines() if line.startswith("grpcurl -")]


def test_reflection_resolves_generate_and_calls_it(loopback_planes):
    with grpc.insecure_channel(loopback_planes.address) as channel:
        client = ReflectionClient(channel)
        assert {"twinplane.v1.Generation", "grpc.health.v1.Health"} <= set(client.services())
        generate = client.method("twinplane.v1.Generation/Generate")
        assert generate.server_streaming and not generate.client_streaming
        assert generate.input_type.full_name == "twinplane.v1.GenerateRequest"
        request_class = message_factory.GetMessageClass(generate.input_type)
        assert request_class is not pb.GenerateRequest  # resolved from the server, not from our stubs

        request = request_class(max_tokens=6, ignore_eos=True)
        request.token_ids.ids.extend([5, 6, 7, 8])
        request.sampling.temperature = 0
        replies = list(client.rpc(generate)(request, timeout=60))

    tokens = [t for reply in replies for t in reply.token_ids]
    finish = generate.output_type.fields_by_name["finish_reason"].enum_type.values_by_number
    assert finish[replies[-1].finish_reason].name == "FINISH_REASON_LENGTH"
    assert replies[-1].usage.completion_tokens == len(tokens) == 6
    with loopback_planes.client() as python_client:
        expected = [t for c in python_client.generate(token_ids=[5, 6, 7, 8], max_tokens=6, temperature=0,
                                                      ignore_eos=True) for t in c.token_ids]
    assert tokens == expected


def test_readme_grpcurl_commands_work_through_reflection(loopback_planes):
    commands = readme_grpcurl_commands()
    results = {}
    with grpc.insecure_channel(loopback_planes.address) as channel:
        client = ReflectionClient(channel)
        for argv in commands:
            assert argv[:2] == ["grpcurl", "-plaintext"], argv
            if argv[-1] == "list":
                results["list"] = client.services()
                continue
            body = json.loads(argv[argv.index("-d") + 1]) if "-d" in argv else {}
            results.setdefault(argv[-1], []).append((body, client.call(argv[-1], body)))  # a method may come twice

    assert set(results) == {"list", "twinplane.v1.Generation/Generate", "twinplane.v1.Generation/Tokenize",
                            "twinplane.v1.Generation/GetModelInfo", "twinplane.v1.Generation/GetStats",
                            "grpc.health.v1.Health/Check"}
    assert "twinplane.v1.Generation" in results["list"]
    (_, generated), (asked, chosen) = results["twinplane.v1.Generation/Generate"]
    assert generated[-1]["finish_reason"] in ("FINISH_REASON_LENGTH", "FINISH_REASON_STOP_TOKEN")
    assert 0 < generated[-1]["usage"]["completion_tokens"] <= 32
    # structured output: one of the choices, then end-of-sequence
    assert "".join(m.get("text", "") for m in chosen) in asked["structured_output"]["choice"]["choices"]
    assert chosen[-1]["finish_reason"] == "FINISH_REASON_STOP_TOKEN"
    with loopback_planes.client() as python_client:
        (text, ids), (chat, chat_ids) = results["twinplane.v1.Generation/Tokenize"]
        assert [int(t) for t in ids[0]["token_ids"]] == python_client.tokenize(text["text"])
        kwargs = chat["chat"]["chat_template_kwargs"]  # a Struct, built from JSON through reflection
        assert [int(t) for t in chat_ids[0]["token_ids"]] == python_client.tokenize(
            messages=chat["chat"]["messages"], chat_template_kwargs=kwargs) and kwargs == {"enable_thinking": False}
    assert results["twinplane.v1.Generation/GetModelInfo"][0][1][0]["vocab_size"] == 49152
    assert results["grpc.health.v1.Health/Check"][0][1] == [{"status": "SERVING"}]
    assert int(results["twinplane.v1.Generation/GetStats"][0][1][0]["steps"]) > 0


REFLECTION_VERSIONS = ("grpc.reflection.v1.ServerReflection", "grpc.reflection.v1alpha.ServerReflection")


def _raw_reflection(channel: grpc.Channel, service: str, requests: list[dict]) -> list[dict]:
    """ServerReflectionInfo of one reflection version, with request and reply classes built here from
    that version's own .proto description (v1 and v1alpha differ only in their package)."""
    from twinplane.controlplane.server import _add_v1_reflection_descriptors

    _add_v1_reflection_descriptors()  # this client's own copy of v1's description, for the message classes
    method = descriptor_pool.Default().FindServiceByName(service).methods_by_name["ServerReflectionInfo"]
    request_class = message_factory.GetMessageClass(method.input_type)
    reply_class = message_factory.GetMessageClass(method.output_type)
    call = channel.stream_stream(f"/{service}/ServerReflectionInfo", request_serializer=request_class.SerializeToString,
                                 response_deserializer=reply_class.FromString)
    replies = call(iter([json_format.ParseDict(r, request_class()) for r in requests]), timeout=30)
    return [json_format.MessageToDict(r, preserving_proto_field_name=True) for r in replies]


def test_reflection_answers_as_v1_and_v1alpha(loopback_planes):
    with grpc.insecure_channel(loopback_planes.address) as channel:
        for service in REFLECTION_VERSIONS:
            listed, described = _raw_reflection(channel, service, [
                {"list_services": ""}, {"file_containing_symbol": "twinplane.v1.Generation"}])
            names = {s["name"] for s in listed["list_services_response"]["service"]}
            assert {"twinplane.v1.Generation", "grpc.health.v1.Health", *REFLECTION_VERSIONS} <= names, service
            assert described["file_descriptor_response"]["file_descriptor_proto"], service
        # every listed service can be described, as `grpcurl describe` does
        for name in sorted(names):
            reply, = _raw_reflection(channel, REFLECTION_VERSIONS[0], [{"file_containing_symbol": name}])
            assert "file_descriptor_response" in reply, name
