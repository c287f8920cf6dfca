import time, os, select, socket, threading
N=3000
for gap in (0.0001, 0.001, 0.005):
    c0=time.process_time(); t0=time.monotonic()
    for _ in range(N): time.sleep(gap)
    c=(time.process_time()-c0)/N*1e6; w=(time.monotonic()-t0)/N*1e6
    print(f"time.sleep({gap}) cpu {c:.1f} us/iter wall {w:.0f}")
ep = select.epoll()
for gap in (0.001,):
    c0=time.process_time()
    for _ in range(N): ep.poll(gap)
    print(f"epoll.poll({gap}) cpu {(time.process_time()-c0)/N*1e6:.1f} us/iter")
# ping-pong between two processes via socketpair: cost per round trip
a, b = socket.socketpair()
pid = os.fork()
if pid == 0:
    a.close()
    while True:
        d = b.recv(64)
        if not d: os._exit(0)
        b.send(d)
b.close()
c0=time.process_time(); t0=time.monotonic()
for _ in range(N):
    a.send(b"x"); a.recv(64)
print(f"socketpair ping-pong cpu {(time.process_time()-c0)/N*1e6:.1f} us/rt (this side) wall {(time.monotonic()-t0)/N*1e6:.1f}")
a.close(); os.waitpid(pid, 0)
