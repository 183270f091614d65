"""Tensor parallelism: the server process is rank 0 and drives ranks 1..N-1.

Rank 0 spawns one process per other rank (spawn context), and every rank joins one
process group (NCCL on GPUs, one GPU a rank; gloo on CPU, where tests check the sharding and
the protocol without GPUs) and builds its own ModelRunner over its shard of the weights. For each
StepPlan, rank 0 copies the plan's protobuf bytes into a shared-memory buffer and
wakes the workers; every rank runs the same step (the layers all-reduce between
them) and only rank 0 samples. A worker acknowledges each message once it has
copied it, and rank 0 waits for those acknowledgements before writing the next.
Nothing is pickled: the plan travels as the same protobuf bytes as on the wire.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import os
import struct
import threading
import time
from multiprocessing import get_context
from multiprocessing.shared_memory import SharedMemory

import torch
import torch.distributed as dist

from twinplane.controlplane.ipc import ignore_group_signals
from twinplane.dataplane.config import DataPlaneConfig

log = logging.getLogger("twinplane.dataplane")
BUFFER_BYTES = 64 << 20  # the largest plan: max_num_batched_tokens tokens and slots, and block tables
HEADER = struct.Struct("<II")  # command, payload length
PARENT_POLL_S = 1.0  # how often an idle worker checks that rank 0 is still there, and rank 0 its workers


class Command(enum.IntEnum):
    STEP = 1
    RESET = 2
    EXIT = 3


def uses_gpus(config: DataPlaneConfig) -> bool:
    """Whether the ranks run on GPUs (the ModelRunner's device rule)."""
    from twinplane.dataplane.model_runner import device_kind

    return device_kind(config.device) == "cuda"


def rendezvous(world: int, port: int = 0) -> dist.TCPStore:
    """Where the ranks meet: rank 0's store on a loopback port the OS chooses (port 0; its ``port``
    says which), or a worker's connection to it."""
    return dist.TCPStore("127.0.0.1", port, world, is_master=port == 0, wait_for_workers=False)


def init_process_group(config: DataPlaneConfig, rank: int, store: dist.TCPStore) -> None:
    world = config.tensor_parallel_size
    if uses_gpus(config):
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", store=store, rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    else:
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)


def worker_main(config: DataPlaneConfig, rank: int, port: int, shm_name: str, wake, ack) -> None:
    """A tensor-parallel rank > 0: runs every step rank 0 sends, until EXIT."""
    from twinplane.dataplane.convert import masks_from_pb, plan_from_pb
    from twinplane.dataplane.main import freeze_heap
    from twinplane.dataplane.model_runner import ModelRunner
    from twinplane.proto import dataplane_pb2 as dp

    ignore_group_signals()  # rank 0 stops the workers (EXIT), after a signal to the process group too
    parent = os.getppid()
    init_process_group(config, rank, rendezvous(config.tensor_parallel_size, port))
    runner = ModelRunner(config)
    freeze_heap(f"data plane rank {rank}")
    # rank 0 owns the block and unlinks it; a spawned worker shares rank 0's resource tracker, which
    # holds it once however many attach, so the worker leaves the tracker alone
    shm = SharedMemory(name=shm_name)
    try:
        while True:
            while not wake.wait(PARENT_POLL_S):
                if os.getppid() != parent:  # rank 0 is gone (killed): no EXIT will come
                    os._exit(1)
            wake.clear()
            command, length = HEADER.unpack_from(shm.buf, 0)
            payload = bytes(shm.buf[HEADER.size:HEADER.size + length])
            ack.set()
            if command == Command.EXIT:
                break
            if command == Command.RESET:
                runner.reset()
                continue
            try:  # queued on the device; rank 0 reads the tokens, so nothing waits here
                msg = dp.StepPlan.FromString(payload)
                if msg.masks_only:  # the sampling of the plan that waits for its masks (rank 0 samples)
                    runner.sample_with_masks(msg.step_id, masks_from_pb(msg))
                else:
                    runner.launch(plan_from_pb(msg))
            except ValueError:  # a bad plan: rank 0 fails the same check and reports it; anything else
                runner.drop_refused(msg.dropped_seq_ids)  # ends this worker, and rank 0 (``_watch``) with it
    finally:
        shm.close()
        runner.close()
        dist.destroy_process_group()


class TensorParallelWorkers:
    """Ranks 1..N-1 and the channel rank 0 uses to send them every plan."""

    def __init__(self, config: DataPlaneConfig) -> None:
        world = config.tensor_parallel_size
        assert world > 1, "no workers needed for tensor_parallel_size 1"
        if uses_gpus(config) and torch.cuda.device_count() < world:
            raise ValueError(f"tensor_parallel_size={world} needs {world} GPUs, found {torch.cuda.device_count()}")
        ctx = get_context("spawn")
        self.store = rendezvous(world)
        port = self.store.port
        self.shm = SharedMemory(create=True, size=BUFFER_BYTES)
        self.wakes = [ctx.Event() for _ in range(world - 1)]
        self.acks = [ctx.Event() for _ in range(world - 1)]
        for ack in self.acks:
            ack.set()
        self.processes = [
            ctx.Process(target=worker_main, args=(config, rank, port, self.shm.name, self.wakes[rank - 1],
                                                  self.acks[rank - 1]), daemon=True, name=f"twinplane-tp{rank}")
            for rank in range(1, world)]
        for p in self.processes:
            p.start()
        self._stopping = False
        threading.Thread(target=self._watch, daemon=True, name="twinplane-tp-watch").start()
        init_process_group(config, 0, self.store)  # this process is rank 0

    def _watch(self) -> None:
        """Ends this process when a worker dies (killed, out of memory, a device error): every step
        after it would wait forever for it, in a collective or for its acknowledgement. Whoever
        started the data plane restarts it; the control plane recomputes what it ran."""
        while not self._stopping:
            dead = [p for p in self.processes if not p.is_alive()]
            if dead and not self._stopping:
                log.critical("tensor-parallel worker %s exited with code %s; the data plane exits with it",
                             dead[0].name, dead[0].exitcode)
                for p in self.processes:
                    p.kill()
                with contextlib.suppress(FileNotFoundError):  # stop() may have begun meanwhile
                    self.shm.unlink()
                os._exit(1)
            time.sleep(PARENT_POLL_S)

    def _send(self, command: Command, payload: bytes = b"") -> None:
        assert HEADER.size + len(payload) <= BUFFER_BYTES, f"plan of {len(payload)} bytes exceeds the buffer"
        for ack in self.acks:  # every worker has copied the previous message
            ack.wait()
            ack.clear()
        HEADER.pack_into(self.shm.buf, 0, command, len(payload))
        self.shm.buf[HEADER.size:HEADER.size + len(payload)] = payload
        for wake in self.wakes:
            wake.set()

    def step(self, plan_bytes: bytes) -> None:
        self._send(Command.STEP, plan_bytes)

    def reset(self) -> None:
        self._send(Command.RESET)

    def kill(self) -> None:
        """Ends every worker at once (rank 0 failed before serving) and releases the shared memory."""
        self._stopping = True
        for p in self.processes:
            p.kill()
            p.join(5)
        self.shm.close()
        self.shm.unlink()

    def stop(self, timeout: float = 30.0) -> None:
        """Stops and joins every worker, then releases the shared memory and the NCCL group."""
        self._stopping = True
        if all(p.is_alive() for p in self.processes):  # one that died would never take the message
            self._send(Command.EXIT)
        for p in self.processes:
            p.join(timeout)
            if p.is_alive():
                log.warning("tensor-parallel worker %s did not exit; killing it", p.name)
                p.kill()
                p.join(5)
        self.shm.close()
        self.shm.unlink()
        if dist.is_initialized():
            dist.destroy_process_group()
