"""The queue contract (wire, streams, DLQ records) and the publisher: launch, resume, cancel,
replay (SPEC §3, §4).

Its names are imported when first used (`__init__.pyi` lists them; ADR-0024): a CLI command
that never publishes does not pay for importing NATS and the S3 client.
"""

import lazy_loader

__getattr__, __dir__, __all__ = lazy_loader.attach_stub(__name__, __file__)
