"""The control plane's two processes: the message channel, a step applied by the core, start and stop
(the token rules themselves: test_finish_rules.py)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from twinplane.controlplane.api import TokenLogprobs
from twinplane.controlplane.ipc import Channel
from twinplane.controlplane.messages import Abort, AddRequest, CoreSnapshot, StepOutputs, TokenOutput
from twinplane.controlplane.sequence import RequestParams


def test_freezing_the_heap_again_first_frees_what_died_since():
    """What a process holds for good is kept out of full collections; an object frozen by one call
    and dropped later (the KV blocks of a data plane that reconnected) is freed by the next call."""
    script = """
import gc, weakref
from twinplane.controlplane.event_loop import freeze_heap
class Node: pass
node = Node(); node.loop = node
dead = weakref.ref(node)
freeze_heap("test")
assert gc.get_freeze_count() > 0
del node
gc.collect()
assert dead() is not None, "a full collection reached a frozen object"
freeze_heap("test")
assert dead() is None, "the next freeze kept an object that died meanwhile"
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_long_garbage_collections_are_logged_at_debug_level():
    """A collection that stalls the streams for a millisecond or more shows up in the debug log,
    once per collection (freezing again does not add a second logger)."""
    script = """
import gc, logging
logging.basicConfig(level=logging.DEBUG, format="%(message)s")
from twinplane.controlplane.event_loop import freeze_heap
freeze_heap("proc"); freeze_heap("proc")
gc.disable()  # only the collection below
class Node: pass
for _ in range(300_000):
    node = Node(); node.loop = node
gc.collect()
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    pauses = [line for line in result.stderr.splitlines() if "garbage collection of generation 2" in line]
    freed = [int(line.split("(")[1].split()[0]) for line in pauses]
    ours = [line for line, n in zip(pauses, freed) if n >= 200_000]  # freeze_heap's own collections free ~0
    assert len(ours) == 1 and ours[0].startswith("proc: "), result.stderr


def test_a_held_event_loop_is_logged_with_where_it_was_held():
    """With DEBUG logging, a callback that holds the event loop for 5 ms or more is logged once, with
    the stack of the loop's thread while it held it; without DEBUG, no watcher runs."""
    script = """
import asyncio, logging, sys, threading, time
logging.basicConfig(level=getattr(logging, sys.argv[1]), format="%(message)s")
from twinplane.controlplane.event_loop import freeze_heap

def hold_the_loop():
    time.sleep(0.2)

async def main():
    freeze_heap("proc"); freeze_heap("proc")
    await asyncio.sleep(0.02)
    hold_the_loop()
    await asyncio.sleep(0.05)
    print(sorted(t.name for t in threading.enumerate() if "watcher" in t.name))

asyncio.run(main())
"""
    for level, watchers in (("DEBUG", "['proc: loop watcher']"), ("INFO", "[]")):
        result = subprocess.run([sys.executable, "-c", script, level], capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == watchers
        held = [line for line in result.stderr.splitlines() if "event loop held for" in line]
        if level == "INFO":
            assert not held, result.stderr
            continue
        assert all(line.startswith("proc: ") for line in held), result.stderr
        # one report per hold (others may come from a loaded machine), with the loop thread's stack then
        reports = result.stderr.split("event loop held for")[1:]
        assert sum("in hold_the_loop" in report for report in reports) == 1, result.stderr


def test_a_frozen_heap_is_still_freed_at_exit():
    """Triton's bindings report every object of theirs still alive when the interpreter ends: a
    process that froze its heap must let the last collection reach it again."""
    pytest.importorskip("triton")
    script = "import triton\nfrom twinplane.controlplane.event_loop import freeze_heap\nfreeze_heap('test')\n"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "leaked" not in result.stderr, result.stderr[-2000:]


def test_messages_arrive_in_order_with_what_they_carry():
    async def run():
        a, b = socket.socketpair()
        sender, receiver = Channel(a), Channel(b)
        await sender.open()
        await receiver.open()
        received, got_all = [], asyncio.Event()

        def dispatch(message):
            received.append(message)
            if message == Abort(999):
                got_all.set()

        serving = asyncio.create_task(receiver.serve(dispatch))
        params = RequestParams(max_tokens=7, stop=("x",))
        prompts = [list(range(n)) for n in (1, 5000, 3)]  # one message larger than a socket buffer
        for i, prompt in enumerate(prompts):
            sender.send(AddRequest(i, f"r{i}", prompt, params))
        sender.send(Abort(999))
        await asyncio.wait_for(got_all.wait(), 10)
        sender.close()
        await asyncio.wait_for(serving, 10)  # the other end closed: serve returns
        receiver.close()
        return received

    received = asyncio.run(run())
    assert [type(message) for message in received] == [AddRequest, AddRequest, AddRequest, Abort]
    assert [message.prompt for message in received[:3]] == [list(range(n)) for n in (1, 5000, 3)]
    assert received[1].params == RequestParams(max_tokens=7, stop=("x",)) and received[3].seq_id == 999


def test_a_channel_that_was_never_opened_closes_its_socket():
    """A process that stops before opening its channels (no event loop even) still closes their sockets: the
    other end sees the channel closed instead of waiting on it; what was sent meanwhile is dropped."""
    a, b = socket.socketpair()
    with b:
        channel = Channel(a)
        channel.send(Abort(1))  # dropped: not open
        channel.close()
        assert a.fileno() == -1
        b.settimeout(10)
        assert b.recv(16) == b""


LEVEL_CHILD = """
import logging
from twinplane.controlplane.ipc import child_argv

def main():
    args, level = child_argv()
    log = logging.getLogger("twinplane.controlplane")
    log.debug("child debug")
    log.info("child info")
    log.warning("child warning: args %s, level %d", args, level)
"""


def test_a_child_process_logs_at_its_parents_level(tmp_path, monkeypatch, capfd):
    """start_process hands a child the parent's log level (after its own args); child_argv sets logging to it."""
    import logging

    from twinplane.controlplane.ipc import start_process

    (tmp_path / "level_child.py").write_text(LEVEL_CHILD)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, (str(tmp_path), os.environ.get("PYTHONPATH")))))
    root, logged = logging.getLogger(), {}
    was = root.level
    try:
        for level in (logging.DEBUG, logging.INFO, logging.WARNING):
            root.setLevel(level)
            capfd.readouterr()
            process = start_process("level_child", ["a", "7"], [])
            assert process.wait(60) == 0
            logged[level] = [line for line in capfd.readouterr().err.splitlines() if " child " in line]
    finally:
        root.setLevel(was)
    for level, names in ((logging.DEBUG, ("debug", "info", "warning")), (logging.INFO, ("info", "warning")),
                         (logging.WARNING, ("warning",))):
        assert [line.split(" child ")[1].split(":")[0] for line in logged[level]] == list(names), logged[level]
        assert logged[level][-1].endswith(f"child warning: args ['a', '7'], level {level}")


def test_step_outputs_cross_as_token_outputs():
    snapshot = CoreSnapshot({"steps": 3})
    outputs = [TokenOutput(7, 2, 3, None, "stop_token", 0), TokenOutput(8, 9, 2, TokenLogprobs(9, -0.5), None, 4)]
    back = pickle.loads(pickle.dumps(StepOutputs(outputs, snapshot), pickle.HIGHEST_PROTOCOL))
    assert back.outputs == outputs and back.snapshot.stats == {"steps": 3}
    assert all(type(output) is TokenOutput for output in back.outputs) and back.outputs[1].num_cached_tokens == 4


class Frontend:
    """Stands in for the frontends: keeps what the core sends."""

    def __init__(self):
        self.messages = []

    def send(self, message):
        self.messages.append(message)



def connected_core(frontend: Frontend, tokenizer_dir, **config):
    """An engine core whose one replica has just connected to a data plane (of 16 KV blocks of 4 tokens, the
    vocabulary of the tokenizer in tokenizer_dir) that it never talks to: the core, and the replica.
    config: more ControlPlaneConfig fields."""
    from twinplane.controlplane import engine_core
    from twinplane.controlplane.block_manager import BlockManager
    from twinplane.controlplane.config import ControlPlaneConfig
    from twinplane.controlplane.scheduler import Scheduler, SchedulerConfig
    from twinplane.proto import dataplane_pb2 as dp

    core = engine_core.EngineCore(ControlPlaneConfig(dataplane="unix:///nowhere", **config), frontend)
    replica = core.replicas[0]
    replica.describe = dp.DescribeResponse(max_model_len=64, eos_token_ids=[2], num_kv_blocks=16, block_size=4,
                                           vocab_size=49152, tokenizer_path=str(tokenizer_dir))
    replica.scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64),
                                  BlockManager(16, 4, True))
    replica._set_connected(True)
    return core, replica


def test_a_request_its_plans_cannot_carry_fails_alone():
    """The API checks every value; should one slip through that a plan's protobuf fields cannot
    hold (top_k past int32), the core fails that request instead of dying on the plan."""
    from twinplane.controlplane.api import SamplingOptions
    from twinplane.controlplane.config import ControlPlaneConfig
    from twinplane.controlplane.engine_core import EngineCore
    from twinplane.controlplane.messages import Rejected

    async def run():
        frontend = Frontend()
        core = EngineCore(ControlPlaneConfig(dataplane="unix:///nowhere"), frontend)
        core.add(AddRequest(7, "bad", [5, 6], RequestParams(max_tokens=3, sampling=SamplingOptions(top_k=1 << 31))))
        core.add(AddRequest(8, "good", [5, 6], RequestParams(max_tokens=3, sampling=SamplingOptions(top_k=5))))
        return core, frontend.messages

    core, messages = asyncio.run(run())
    assert [type(m) for m in messages] == [Rejected] and messages[0].seq_id == 7
    assert "outside what the data plane takes" in messages[0].why and "out of range" in messages[0].why.lower()
    assert list(core.seqs) == [8] and [s.seq_id for s in core.unrouted] == [8]


def test_the_core_keeps_each_frontends_requests_apart_and_ends_them_when_it_is_gone():
    """With two frontends, the core counts each one's added and waiting requests apart; an abort takes
    a request out of the queue for a data plane; once a frontend's channel closes, its requests end and
    the other's wait on; Shutdown stops the core."""
    from twinplane.controlplane.config import ControlPlaneConfig
    from twinplane.controlplane.engine_core import EngineCore
    from twinplane.controlplane.messages import Shutdown

    async def run():
        core = EngineCore(ControlPlaneConfig(dataplane="unix:///nowhere", api_server_count=2), Frontend())
        for seq_id in (2, 3, 4, 5, 7):  # frontend 0 numbers its sequences 2, 4, ...; frontend 1 3, 5, 7, ...
            core.receive(AddRequest(seq_id, f"r{seq_id}", [5, 6], RequestParams(max_tokens=3)))
        core.receive(Abort(5))
        before = core.snapshot()
        core.frontend_gone(1)
        after = core.snapshot()
        core.receive(Shutdown())
        return core, before, after

    core, before, after = asyncio.run(run())
    assert (before.added_by_frontend, before.waiting_by_frontend, before.waiting) == ((2, 3), (2, 2), 4)
    assert (after.waiting_by_frontend, after.waiting) == ((2, 0), 2)
    assert sorted(core.seqs) == [2, 4] and [seq.seq_id for seq in core.unrouted] == [2, 4]
    assert core.stopped.is_set() and core.frontend.messages == []


def test_when_a_frontends_channel_closes_its_running_requests_are_freed_and_the_others_run_on():
    """A frontend's channel closes (its process died): the core ends that frontend's requests, running ones
    (their KV blocks freed, the data plane told to drop them) and waiting ones alike; the other frontend's
    requests keep their places and blocks."""
    from twinplane.controlplane.engine_core import _serve_frontend
    from twinplane.controlplane.sequence import SequenceStatus

    async def run():
        core, replica = connected_core(Frontend(), "", api_server_count=2)
        a, b = socket.socketpair()
        frontend, core_end = Channel(a), Channel(b)
        await frontend.open()
        await core_end.open()
        serving = asyncio.create_task(_serve_frontend(core, 1, core_end))
        for seq_id in (2, 4):  # frontend 0's
            core.receive(AddRequest(seq_id, f"r{seq_id}", [5, 6, 7, 8, 9], RequestParams(max_tokens=8)))
        for seq_id in (3, 5, 7):  # frontend 1's, over its channel
            frontend.send(AddRequest(seq_id, f"r{seq_id}", [5, 6, 7, 8, 9], RequestParams(max_tokens=8)))
        while len(core.seqs) < 5:
            await asyncio.sleep(0.01)
        out = replica.scheduler.schedule()  # admits four (max_num_seqs): 7 waits
        assert sorted(chunk.seq.seq_id for chunk in out.chunks) == [2, 3, 4, 5]
        kept = {seq_id: list(core.seqs[seq_id].block_table) for seq_id in (2, 4)}
        frontend.close()
        await asyncio.wait_for(serving, 10)  # the channel closed: the core ended frontend 1's requests
        return core, replica, kept

    core, replica, kept = asyncio.run(run())
    sched = replica.scheduler
    assert sorted(core.seqs) == [2, 4] and not core.replica_of.keys() - {2, 4}
    assert [seq.seq_id for seq in sched.running] == [2, 4] and not sched.waiting
    assert all(core.seqs[i].status is SequenceStatus.RUNNING and core.seqs[i].block_table == kept[i] for i in kept)
    assert sched.block_manager.num_free_blocks == 16 - 4  # two blocks each for frontend 0's two requests
    assert sorted(sched.dropped_seq_ids) == [3, 5]  # the data plane mirrored these: it drops them next step
    snapshot = core.snapshot()
    assert (snapshot.running, snapshot.waiting, snapshot.waiting_by_frontend) == (2, 0, (0, 0))


def test_the_core_applies_a_step_counts_it_and_logs_it_at_debug(caplog):
    import numpy as np

    from twinplane.controlplane.block_manager import BlockManager
    from twinplane.controlplane.config import ControlPlaneConfig
    from twinplane.controlplane.engine_core import EngineCore
    from twinplane.controlplane.scheduler import Scheduler, SchedulerConfig
    from twinplane.proto import dataplane_pb2 as dp

    async def run():
        frontend = Frontend()
        core = EngineCore(ControlPlaneConfig(dataplane="unix:///nowhere"), frontend)
        replica = core.replicas[0]
        replica.describe = dp.DescribeResponse(max_model_len=64, eos_token_ids=[2], num_kv_blocks=16, block_size=4)
        replica.scheduler = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=64),
                                      BlockManager(16, 4, True))
        replica._set_connected(True)
        core.add(AddRequest(7, "a", [5, 6, 7], RequestParams(max_tokens=3)))
        core.add(AddRequest(8, "b", [5, 6], RequestParams(max_tokens=3)))
        out = replica.scheduler.schedule()
        result = dp.StepResult(step_id=out.step_id, sampled_token_ids=np.array([2, 9], "<i4").tobytes(),
                               timings=dp.StepTimings(idle_us=40, execute_us=900, prepare_us=60, launch_us=350,
                                                      path=dp.STEP_PATH_MIXED_GRAPH))
        with caplog.at_level("DEBUG", logger="twinplane.controlplane.steps"):
            outputs = replica._apply(out, result)
        return core, outputs, out.step_id

    core, outputs, step_id = asyncio.run(run())
    # seq 7 sampled eos (2) at position 3 and ends; seq 8 goes on
    assert [out[:-1] for out in outputs] == [(7, 2, 3, None, "stop_token", 0, None), (8, 9, 2, None, None, 0, None)]
    assert all(0 < time.monotonic() - out.scheduled_time < 60 for out in outputs)  # with a first token: when planned
    assert list(core.seqs) == [8] and core.snapshot().running == 1
    stats = core.snapshot().stats
    assert (stats["steps"], stats["idle_us"], stats["execute_us"], stats["computed_tokens"]) == (1, 40, 900, 5)
    assert stats["mixed_graph_steps"] == 1 and stats["full_decode_steps"] == 0 and stats["launch_us"] == 350
    assert [r.getMessage() for r in caplog.records] == [
        f"step {step_id}: 2 sequences, 5 tokens, path mixed_graph, idle 40 us, prepare 60 us, "
        "execute 900 us"]


def test_a_replayed_request_reports_the_cache_hit_of_its_first_admission():
    """A request recomputed on a fresh KV cache (its data plane lost before its first token) or sent again to a
    new engine core (with its tokens so far and the count its frontend had) reports the cached prompt tokens of
    its first admission with each token, not the replay's."""
    import numpy as np

    from twinplane.proto import dataplane_pb2 as dp

    def run_step(replica, tokens: list[int]):
        out = replica.scheduler.schedule()
        result = dp.StepResult(step_id=out.step_id, sampled_token_ids=np.array(tokens, "<i4").tobytes())
        return {o.seq_id: o.num_cached_tokens for o in replica._apply(out, result)}

    async def run():
        core, replica = connected_core(Frontend(), "")
        prompt, params = list(range(5, 15)), RequestParams(max_tokens=8)  # 10 tokens: two full blocks of 4
        core.add(AddRequest(1, "warm", prompt, params))
        run_step(replica, [9])
        core.abort(1)  # its prompt's two full blocks stay in the prefix cache
        core.add(AddRequest(2, "hit", prompt, params))
        replica.scheduler.schedule()  # admitted with 8 cached tokens; its first token is in flight
        core.recompute(replica, replica.scheduler.evict_all())  # the data plane is lost with its KV cache
        core.add(AddRequest(3, "replayed", prompt, params, output_ids=[9], num_cached_tokens=4))
        return run_step(replica, [9, 9])  # both admitted on an empty cache

    assert asyncio.run(run()) == {2: 8, 3: 4}


async def _core_heard(plane, timeout: float = 60.0) -> None:
    """Waits for the engine core's first message (a heartbeat): the core is up, past its imports."""
    deadline = time.monotonic() + timeout
    while (channel := plane.engine.supervisor.channel) is None or channel.num_received == 0:
        assert time.monotonic() < deadline, f"the engine core said nothing in {timeout:.0f} s"
        await asyncio.sleep(0.05)


def test_a_core_still_waiting_for_its_data_plane_stops_at_once(tmp_path):
    import time

    from twinplane.controlplane.config import ControlPlaneConfig
    from twinplane.controlplane.main import ControlPlane

    async def run():
        plane = ControlPlane(ControlPlaneConfig(dataplane=f"unix://{tmp_path}/nobody.sock",
                                                listen=f"unix://{tmp_path}/cp.sock"))
        await plane.start()
        await _core_heard(plane)  # its start-up (seconds on a loaded machine) is not what is timed here
        await asyncio.sleep(1.5)  # the core is retrying the data plane
        started = time.monotonic()
        await plane.shutdown(grace=0)
        return time.monotonic() - started, plane.engine.supervisor.process.returncode

    seconds, exitcode = asyncio.run(run())
    assert exitcode == 0 and seconds < 4.5  # shut down, not killed after the 5 s timeout


def test_ctrl_c_on_the_process_group_shuts_down_cleanly(tmp_path):
    """SIGINT reaches the engine core too; the core leaves the shutdown to the frontend."""
    import subprocess
    import sys
    import time

    from twinplane.clients.client import Client

    api = f"unix://{tmp_path}/cp.sock"
    control = subprocess.Popen([sys.executable, "-m", "twinplane.clients.cli", "controlplane", "--dataplane",
                                f"unix://{tmp_path}/nobody.sock", "--listen", api],
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        with Client(api) as client:  # the server answers (NOT_SERVING: no data plane) once it is up
            deadline = time.monotonic() + 60
            while client.health_status(1.0) != "NOT_SERVING" and time.monotonic() < deadline:
                time.sleep(0.2)
        os.killpg(control.pid, signal.SIGINT)
        stderr = control.communicate(timeout=30)[1]
    finally:
        if control.poll() is None:
            control.kill()
    assert control.returncode == 0, stderr[-2000:]
    assert "shutting down" in stderr and "Traceback" not in stderr and "CRITICAL" not in stderr, stderr[-2000:]


def test_a_script_without_a_main_guard_can_run_a_control_plane(tmp_path):
    """The engine core starts as its own program: it never imports the script that embeds the control plane."""
    import subprocess
    import sys

    script = tmp_path / "embed.py"
    script.write_text(f"""
import asyncio
from twinplane.controlplane.config import ControlPlaneConfig
from twinplane.controlplane.main import ControlPlane
print("script ran", flush=True)

async def run():
    plane = ControlPlane(ControlPlaneConfig(dataplane="unix://{tmp_path}/nobody.sock", listen="unix://{tmp_path}/cp.sock"))
    await plane.start()
    # once the core is up (its first message): one still importing on a loaded machine could be killed for
    # taking past the stop timeout
    while plane.engine.supervisor.channel is None or not plane.engine.supervisor.channel.num_received:
        await asyncio.sleep(0.05)
    await asyncio.sleep(1.0)
    await plane.shutdown(grace=0)
    print("core exit code", plane.engine.supervisor.process.returncode, flush=True)

asyncio.run(run())
""")
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.splitlines() == ["script ran", "core exit code 0"], result.stdout


def test_sigint_while_the_core_is_still_starting_is_ignored(tmp_path):
    """Ctrl-C can reach the core's process group before the core has imported anything: it starts
    with SIGINT blocked, so no signal sent during its start-up ends it; closing the channel does."""
    import time

    from twinplane.controlplane.config import ControlPlaneConfig
    from twinplane.controlplane.engine_core import start_core_process

    process, sock, others = start_core_process(ControlPlaneConfig(dataplane=f"unix://{tmp_path}/nobody.sock"))
    assert others == []  # one frontend
    try:
        deadline = time.monotonic() + 3.0  # start-up (interpreter, imports) takes well under a second
        while time.monotonic() < deadline and process.poll() is None:
            os.kill(process.pid, signal.SIGINT)
            time.sleep(0.005)
        assert process.poll() is None, f"SIGINT during start-up ended the engine core (exit {process.returncode})"
    finally:
        sock.close()  # the frontend is gone before it said anything: the core exits
        if process.poll() is None and process.wait(timeout=30) is None:
            process.kill()
    assert process.returncode == 0


@pytest.mark.parametrize("with_tokenizer", [True, False])
def test_the_vocabulary_is_read_off_the_step_loop_once_a_data_plane_connects(smollm2_dir, with_tokenizer):
    """Structured output's token bytes are read in a thread of their own when the first data plane describes
    the model, so the first such request finds them ready; without a tokenizer such requests fail alone."""
    from twinplane.controlplane.block_manager import BlockManager
    from twinplane.controlplane.config import ControlPlaneConfig
    from twinplane.controlplane.engine_core import EngineCore
    from twinplane.controlplane.json_schema import any_json_regex
    from twinplane.controlplane.messages import Rejected
    from twinplane.controlplane.scheduler import Scheduler, SchedulerConfig
    from twinplane.controlplane.structured import compiled
    from twinplane.proto import dataplane_pb2 as dp

    async def run():
        frontend = Frontend()
        core = EngineCore(ControlPlaneConfig(dataplane="unix:///nowhere"), frontend)
        replica = core.replicas[0]
        replica.describe = dp.DescribeResponse(max_model_len=64, eos_token_ids=[2], num_kv_blocks=16, block_size=4,
                                               vocab_size=49152, tokenizer_path=str(smollm2_dir) if with_tokenizer
                                               else "")
        replica.scheduler = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=64),
                                      BlockManager(16, 4, True))
        assert core._vocabulary is None
        replica._set_connected(True)
        reading = core._vocabulary
        with contextlib.suppress(ValueError):
            reading.result(timeout=60)
        core.add(AddRequest(7, "json", [5, 6], RequestParams(max_tokens=3, regex="yes|no")))
        core.add(AddRequest(8, "free", [5, 6], RequestParams(max_tokens=3)))
        for _ in range(600):  # its grammar compiles off the loop
            if not core.preparing:
                break
            await asyncio.sleep(0.05)
        return core, reading, frontend.messages

    compiled.cache_clear()
    core, reading, messages = asyncio.run(run())
    assert core._vocabulary is reading  # read once
    rejected = [m for m in messages if isinstance(m, Rejected)]
    if with_tokenizer:
        assert not rejected and core.seqs[7].matcher is not None and len(reading.result().token_bytes) == 49152
        assert list(core.seqs) == [7, 8]
        for thread in threading.enumerate():
            if thread.name == "twinplane-vocabulary":
                thread.join(60)
        misses = compiled.cache_info().misses
        compiled(any_json_regex())  # {"type": "json_object"}'s grammar was compiled in that thread too
        assert compiled.cache_info().misses == misses
    else:
        assert [m.seq_id for m in rejected] == [7] and "start the control plane with --tokenizer" in rejected[0].why
        assert list(core.seqs) == [8]


def test_structured_requests_that_come_while_the_vocabulary_is_read_wait_for_it_alone(smollm2_dir, monkeypatch):
    """A structured-output request that comes before the vocabulary is read waits for it without holding
    up the core (a free request is routed at once); once it is read, such requests go on, except those
    aborted meanwhile, which stop counting as waiting when they are aborted."""
    import threading

    from twinplane.controlplane import engine_core
    from twinplane.controlplane.messages import Rejected

    release = threading.Event()

    class SlowVocabulary(engine_core.Vocabulary):
        def __init__(self, *args):
            release.wait(30)
            super().__init__(*args)

    monkeypatch.setattr(engine_core, "Vocabulary", SlowVocabulary)

    async def run():
        frontend = Frontend()
        core, replica = connected_core(frontend, smollm2_dir)  # the vocabulary is being read
        core.add(AddRequest(7, "json", [5, 6], RequestParams(max_tokens=3, regex="yes|no")))
        core.add(AddRequest(8, "free", [5, 6], RequestParams(max_tokens=3)))
        core.add(AddRequest(9, "gone", [5, 6], RequestParams(max_tokens=3, regex="yes")))
        waiting, snapshot = [s.seq_id for s in replica.scheduler.waiting], core.snapshot()
        core.abort(9)
        after_abort = core.snapshot()
        release.set()
        for _ in range(600):
            await asyncio.sleep(0.05)
            if not core.preparing:
                break
        return core, replica, waiting, (snapshot, after_abort), frontend.messages

    core, replica, waiting, (snapshot, after_abort), messages = asyncio.run(run())
    assert waiting == [8] and snapshot.unrouted == 2  # the two that wait count as waiting
    assert after_abort.unrouted == 1  # an aborted one no longer does
    assert [s.seq_id for s in replica.scheduler.waiting] == [8, 7] and list(core.seqs) == [7, 8]
    assert core.seqs[7].matcher is not None
    assert not [m for m in messages if isinstance(m, Rejected)]


def test_a_grammar_compiles_off_the_step_loop(smollm2_dir, monkeypatch):
    """A structured-output request whose grammar takes long to compile (a large schema's) waits for it in a
    thread of its own; the core goes on (a free request is routed at once), a second request of the same
    grammar waits for the same compilation, and both go on once it is done."""
    import threading

    from twinplane.controlplane import engine_core
    from twinplane.controlplane.structured import compiled

    release, threads = threading.Event(), []

    def slow(regex):
        threads.append(threading.current_thread().name)
        release.wait(30)
        return compiled(regex)

    monkeypatch.setattr(engine_core, "compiled", slow)

    async def run():
        frontend = Frontend()
        core, replica = connected_core(frontend, smollm2_dir)
        core._vocabulary.result(timeout=60)
        for seq_id, regex in ((7, "a+b"), (8, None), (9, "a+b")):
            core.add(AddRequest(seq_id, "r", [5, 6], RequestParams(max_tokens=3, regex=regex)))
        routed = [s.seq_id for s in replica.scheduler.waiting]
        release.set()
        for _ in range(600):
            await asyncio.sleep(0.05)
            if not core.preparing:
                break
        return core, replica, routed

    core, replica, routed = asyncio.run(run())
    assert routed == [8] and threads == ["twinplane-grammar_0"]  # compiled once, in its thread
    assert [s.seq_id for s in replica.scheduler.waiting] == [8, 7, 9]
    assert core.seqs[7].matcher.grammar is core.seqs[9].matcher.grammar


def test_a_grammar_whose_automaton_is_crowded_is_compiled_afresh_for_new_requests(smollm2_dir, monkeypatch):
    """A grammar's automaton grows as requests walk it, up to MAX_DFA_STATES; once most of them are built, a new
    request of the same grammar gets a fresh automaton, and the sequences in the crowded one keep the rest (so
    that one schema's earlier requests never fail its later ones)."""
    from twinplane.controlplane import grammar as grammar_module

    monkeypatch.setattr(grammar_module, "MAX_DFA_STATES", 40)
    regex = "[a-z]{0,60}"  # a state per letter written

    async def add(core, seq_id):
        core.add(AddRequest(seq_id, "r", [5, 6], RequestParams(max_tokens=3, regex=regex)))
        for _ in range(600):
            if not core.preparing:
                break
            await asyncio.sleep(0.05)
        return core.seqs[seq_id].matcher.grammar

    async def run():
        core, _ = connected_core(Frontend(), smollm2_dir)
        core._vocabulary.result(timeout=60)
        first = await add(core, 7)
        assert await add(core, 8) is first  # not crowded yet: shared
        state = first.advance(first.initial_state, b"abcdefghijklmnopqrstuvwxyzabcd")  # 32 of its 40 states built
        assert first.crowded
        fresh = await add(core, 9)
        assert fresh is not first and not fresh.crowded and await add(core, 10) is fresh
        assert first.is_accepting(first.advance(state, b"abcdefgh"))  # the crowded one still serves its sequences

    asyncio.run(run())
