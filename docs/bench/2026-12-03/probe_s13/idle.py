import asyncio, sys, time
sys.path.insert(0, "/work/main")
from bench.common import Bench, LeaseEnv, loaded, ONE_NODE, process_cpu_seconds, machine_cpu_seconds
async def main():
    async with Bench("lp", lease=LeaseEnv()) as bench:
        rnd = await bench.new_round("lp")
        await rnd.start_runners(2, 16)
        wf = loaded(ONE_NODE)
        for _ in range(50):
            await rnd.publisher.launch(wf, {}, tenant="default")
        await rnd.wait_finished(50, within=60)
        await asyncio.sleep(2)
        def snap():
            return ([r.cpu_seconds() for r in rnd.runners], process_cpu_seconds(bench.server.pid), time.process_time(), machine_cpu_seconds())
        a = snap(); await asyncio.sleep(10); b = snap()
        print("idle 10 s: runners", [round(y - x, 3) for x, y in zip(a[0], b[0])], "nats", round(b[1]-a[1], 3), "bench", round(b[2]-a[2], 3), "machine busy", round(100*(b[3][0]-a[3][0])/(b[3][1]-a[3][1]), 1), "%")
        await bench.end_round(rnd)
asyncio.run(main())
