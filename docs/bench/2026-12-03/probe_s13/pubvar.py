import asyncio, sys, time, itertools, orjson
sys.path.insert(0, "/work/main")
from bench.common import Bench, LeaseEnv

async def main():
    async with Bench("lp", lease=LeaseEnv()) as bench:
        rnd = await bench.new_round("lp")
        nc, js = bench.nc, bench.js
        subj, stream = rnd.names.runs_subject, rnd.names.runs_stream
        N = 3000
        pending = {}
        inbox = nc.new_inbox()
        async def cb(msg):
            fut = pending.pop(msg.subject, None)
            if fut is not None and not fut.done():
                fut.set_result(msg)
        await nc.subscribe(inbox + ".*", cb=cb)
        ctr = itertools.count()
        loop = asyncio.get_running_loop()
        async def custom(i):
            reply = f"{inbox}.{next(ctr)}"
            fut = loop.create_future(); pending[reply] = fut
            await nc.publish(subj, b'{"x":1}', reply=reply, headers={"Nats-Msg-Id": f"c{i}-{time.time()}"})
            msg = await asyncio.wait_for(fut, 5)
            return orjson.loads(msg.data)
        async def jsp(i):
            return await js.publish(subj, b'{"x":1}', stream=stream, headers={"Nats-Msg-Id": f"j{i}-{time.time()}"})
        async def req(i):
            return await nc.request(subj, b'{"x":1}', timeout=5, headers={"Nats-Msg-Id": f"r{i}-{time.time()}"})
        for rnd_ in range(2):
            for name, fn in (("js.publish", jsp), ("nc.request", req), ("custom", custom)):
                c0 = time.process_time(); t0 = time.monotonic()
                for i in range(N):
                    await fn(i)
                print(f"{name:12s} cpu {(time.process_time()-c0)/N*1e6:6.1f} us wall {(time.monotonic()-t0)/N*1e6:6.1f} us", flush=True)
        print(await custom(99999))
        await bench.end_round(rnd)
asyncio.run(main())
