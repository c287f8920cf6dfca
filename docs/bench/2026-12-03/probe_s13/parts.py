import asyncio, sys, time
sys.path.insert(0, "/work/main")
from bench.common import Bench, LeaseEnv, loaded, ONE_NODE
from store.protocols import EventDraft
from publisher.wire import RunMessage, encode as wencode
from store.timeutil import utcnow

async def main():
    async with Bench("lp", lease=LeaseEnv()) as bench:
        rnd = await bench.new_round("lp")
        wf = loaded(ONE_NODE); pub = rnd.publisher
        docs = [await pub.launch(wf, {}, tenant="default") for _ in range(50)]
        import pieces_mk
        N = 3000
        async def measure(name, fn, gap):
            c0 = time.process_time(); t0 = time.monotonic()
            for i in range(N):
                await fn(i)
                if gap: await asyncio.sleep(gap)
            c = (time.process_time() - c0) / N * 1e6; w = (time.monotonic() - t0) / N * 1e6
            print(f"{name:28s} gap={gap} cpu {c:7.1f} us  wall {w:7.1f} us", flush=True)
        mk = pieces_mk.mk
        async def create(i):
            await rnd.store.create_run(mk(), events=[EventDraft("run_launched", {"workflow": "x"}, attempt=1), EventDraft("run_queued", {"attempt": 1, "kind": "launch"}, attempt=1)])
        d0 = docs[0]
        async def publish(i):
            await bench.js.publish(rnd.names.runs_subject, b'{"x":1}', stream=rnd.names.runs_stream, headers={"Nats-Msg-Id": f"x{i}-{time.time()}"})
        async def nothing(i):
            pass
        async def launch(i):
            await pub.launch(wf, {}, tenant="default")
        for gap in (0, 0.001):
            await measure("sleep only", nothing, gap)
            await measure("create_run", create, gap)
            await measure("js.publish", publish, gap)
            await measure("launch", launch, gap)
        await pub.flush()
        await bench.end_round(rnd)
asyncio.run(main())
