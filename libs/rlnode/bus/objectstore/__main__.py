"""`python -m rlnode.bus.objectstore --data-dir DIR --credentials FILE [--port N]`: serve
the object store until SIGTERM / Ctrl-C."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from aiohttp import web

from rlnode.bus.objectstore.files import ObjectFiles
from rlnode.bus.objectstore.process import RETENTION_EVERY_S, read_credentials
from rlnode.bus.objectstore.retention import RetentionSweeper, sweep_every
from rlnode.bus.objectstore.server import make_app
from rlnode.service.files import make_private


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m rlnode.bus.objectstore")
    parser.add_argument("--data-dir", type=Path, required=True, help="where the objects live")
    parser.add_argument(
        "--credentials", type=Path, required=True, help="JSON file with the access key (0600)"
    )
    parser.add_argument("--host", default="127.0.0.1", help="listen address (loopback)")
    parser.add_argument("--port", type=int, default=9000)
    parser.add_argument("--bucket", action="append", default=[], help="create this bucket")
    parser.add_argument("--verbose", action="store_true", help="log every request")
    parser.add_argument(
        "--retention-every-s",
        type=float,
        default=RETENTION_EVERY_S,
        help="apply the broker's topic retention to each bucket this often (0: never)",
    )
    parser.add_argument(
        "--once-read",
        action="append",
        default=[],
        metavar="TOPIC=SECONDS",
        help="a topic whose records go once every group holding them has read them and "
        "they are this old",
    )
    args = parser.parse_args(argv)
    try:
        once_read = {
            topic: float(seconds)
            for topic, seconds in (item.rsplit("=", 1) for item in args.once_read)
        }
    except ValueError:
        parser.error(f"--once-read takes TOPIC=SECONDS, got {args.once_read}")
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    make_private()
    files = ObjectFiles(args.data_dir)
    for bucket in args.bucket:
        files.create_bucket(bucket)
    if args.retention_every_s > 0:
        for bucket in args.bucket:
            sweep_every(RetentionSweeper(files, bucket, once_read), args.retention_every_s)
    app = make_app(files, read_credentials(args.credentials))
    web.run_app(app, host=args.host, port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
