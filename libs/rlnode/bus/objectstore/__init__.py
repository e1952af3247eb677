"""A small durable S3-compatible object store, the embedded broker's storage (#28).

Tansu keeps a cluster's topics, records and consumer-group offsets in an object store
(its "dynostore", through Rust's object_store crate), relying on conditional PUTs for its
compare-and-swap of metadata. This store is the subset of S3 that client uses, with objects
as fsync'd files under a data directory (`files`), requests authenticated with AWS
Signature V4 (`sigv4`), the HTTP surface (`server`), and the process the node runs
(`process`: `python -m rlnode.bus.objectstore`).
"""

from rlnode.bus.objectstore.process import (
    BUCKET,
    LocalObjectStore,
    ObjectStoreError,
    ensure_credentials,
    read_credentials,
)
from rlnode.bus.objectstore.sigv4 import Credentials

__all__ = [
    "BUCKET",
    "Credentials",
    "LocalObjectStore",
    "ObjectStoreError",
    "ensure_credentials",
    "read_credentials",
]
