"""A delivery as the runner sees it: the bytes, where it sits in the stream, and the four things
one can do with it. Wrapping nats-py's `Msg` keeps its fire-and-forget vs confirmed acks in one
place (NOTES.md: only `ack_sync` is confirmed; every ack on a last delivery uses it)."""

from __future__ import annotations

from dataclasses import dataclass, field

from nats.aio.msg import Msg

from publisher.wire import RunMessage
from runner.admission import DeliveryInfo


@dataclass
class Delivery:
    msg: Msg
    info: DeliveryInfo
    disposed: str | None = field(default=None)
    message: RunMessage | None = field(default=None)
    """Set once decoded, so a last-resort DLQ record still names its run."""
    leased: bool = field(default=False)
    """Set once a claim won: an unexpected error after that never writes a DLQ record."""
    settling: bool = field(default=False)
    """Set as an ack or nak is sent: no working ack may follow it (`in_progress`)."""

    @classmethod
    def from_msg(cls, msg: Msg, max_deliver: int) -> Delivery:
        meta = msg.metadata
        return cls(
            msg=msg,
            info=DeliveryInfo(
                stream_seq=meta.sequence.stream,
                num_delivered=meta.num_delivered,
                max_deliver=max_deliver,
            ),
        )

    @property
    def data(self) -> bytes:
        return self.msg.data

    @property
    def headers(self) -> dict[str, str]:
        return dict(self.msg.headers or {})

    async def ack(self) -> None:
        """Acks on a last delivery are confirmed (`ack_sync`): a lost one would leave the
        message to the MAX_DELIVERIES advisory after the run was already settled."""
        self.settling = True
        if self.info.is_last:
            await self.msg.ack_sync()
        else:
            await self.msg.ack()
        self.disposed = "ack"

    async def ack_sync(self) -> None:
        self.settling = True
        await self.msg.ack_sync()
        self.disposed = "ack"

    async def nak(self, delay: float) -> None:
        self.settling = True
        await self.msg.nak(delay=delay)
        self.disposed = "nak"

    async def in_progress(self) -> None:
        """A working ack, unless an ack or nak has been sent. The lease keeper's last beat can
        land after the disposition (its refresh was in flight when the release was written),
        and JetStream takes a working ack after a nak as "still working": the redelivery then
        comes after `ack_wait` instead of the nak's delay (found by review)."""
        if self.settling:
            return
        await self.msg.in_progress()
