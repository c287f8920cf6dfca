import asyncio, sys, time
sys.path.insert(0, "/work/main")
from bench.common import Bench, LeaseEnv, loaded, ONE_NODE

async def main(n, rate):
    async with Bench("lp", lease=LeaseEnv()) as bench:
        rnd = await bench.new_round("lp")
        await rnd.start_runners(2, 16)
        wf = loaded(ONE_NODE)
        pub = rnd.publisher
        for _ in range(200):
            await pub.launch(wf, {}, tenant="default")
        print("GO", flush=True)
        c0 = time.process_time(); t0 = time.monotonic()
        tasks = []
        for i in range(n):
            d = t0 + i / rate - time.monotonic()
            if d > 0:
                await asyncio.sleep(d)
            tasks.append(asyncio.ensure_future(pub.launch(wf, {}, tenant="default")))
        await asyncio.gather(*tasks)
        c1 = time.process_time(); t1 = time.monotonic()
        print(f"{n} launches in {t1-t0:.2f}s, cpu {1e3*(c1-c0)/n:.3f} ms/launch", flush=True)
        await rnd.wait_finished(n + 200, within=120)
        await bench.end_round(rnd)

asyncio.run(main(int(sys.argv[1]), float(sys.argv[2])))
