"""Are MAX_DELIVERIES advisories captured around a nats-server restart? (fifteenth pass)

    python advisory_capture.py restart_mid|restart_before|nak     # 40 messages, max_deliver 2
    python advisory_capture.py shutdown OFFSET [N]                # N messages (2 000), the
        SIGTERM placed 0.95 + OFFSET s after the last delivery (ack_wait 1 s)

Prints how many advisories the capture stream holds against the messages max-delivered.
"""

import asyncio
import sys
import tempfile
from pathlib import Path

import nats
from nats.js.api import AckPolicy, ConsumerConfig, RetentionPolicy, StorageType, StreamConfig

from runner.localnats import NatsServer


async def wait_conn(nc):
    for _ in range(400):
        if nc.is_connected:
            return
        await asyncio.sleep(0.05)


async def setup():
    srv = NatsServer(Path(tempfile.mkdtemp()))
    srv.start()
    nc = await nats.connect(srv.url, max_reconnect_attempts=-1, reconnect_time_wait=0.1)
    js = nc.jetstream()
    await js.add_stream(StreamConfig(name="W", subjects=["w.>"], retention=RetentionPolicy.WORK_QUEUE, storage=StorageType.FILE))
    await js.add_stream(StreamConfig(name="A", subjects=["$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.W.*"], storage=StorageType.FILE))
    await js.add_consumer("W", ConsumerConfig(durable_name="c", ack_policy=AckPolicy.EXPLICIT, ack_wait=1, max_deliver=2, filter_subject="w.>", max_ack_pending=-1))
    return srv, nc, js, await js.pull_subscribe_bind("c", stream="W")


async def restart(srv, nc):
    await asyncio.to_thread(srv.stop)
    await asyncio.to_thread(srv.start)
    await wait_conn(nc)


async def report(tag, srv, nc, js, n):
    ai = await js.stream_info("A")
    wi = await js.stream_info("W")
    print(f"{tag}: advisories {ai.state.messages} of {n}; work msgs {wi.state.messages}", flush=True)
    await nc.close()
    srv.stop()


async def variants(variant, n=40):
    srv, nc, js, sub = await setup()
    for i in range(n):
        await js.publish(f"w.{i}", b"x")

    async def drain(t):
        end = asyncio.get_running_loop().time() + t
        while asyncio.get_running_loop().time() < end:
            try:
                msgs = await sub.fetch(100, timeout=0.5)
            except Exception:
                continue
            for m in msgs:
                if variant == "nak":
                    await m.nak()

    await drain(0.8)  # delivery 1, no ack
    if variant == "restart_mid":
        await asyncio.sleep(1.2)
        await drain(0.5)  # delivery 2 (the last), pending
    await restart(srv, nc)
    await drain(6)
    await report(variant, srv, nc, js, n)


async def shutdown(offset, n):
    srv, nc, js, sub = await setup()
    for i in range(n):
        await js.publish(f"w.{i}", b"x")

    async def take(want):
        got = 0
        while got < want:
            try:
                got += len(await sub.fetch(min(500, want - got), timeout=2))
            except Exception:
                break

    await take(n)  # delivery 1
    await take(n)  # delivery 2, the last

    async def puller():  # a pull waiting, so the expiries are processed
        while True:
            try:
                await sub.fetch(100, timeout=0.5)
            except Exception:
                pass

    p = asyncio.create_task(puller())
    await asyncio.sleep(0.95 + offset)
    await restart(srv, nc)
    await asyncio.sleep(4)
    p.cancel()
    await report(f"shutdown {offset:+}", srv, nc, js, n)


if __name__ == "__main__":
    if sys.argv[1] == "shutdown":
        asyncio.run(shutdown(float(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else 2000))
    else:
        asyncio.run(variants(sys.argv[1]))
