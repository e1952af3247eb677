"""`python -m rlnode.bus.objectstore --data-dir DIR --credentials FILE [--port N]`: serve
the object store until SIGTERM / Ctrl-C."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from aiohttp import web

from rlnode.bus.objectstore.files import ObjectFiles
from rlnode.bus.objectstore.process import read_credentials
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
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    make_private()
    files = ObjectFiles(args.data_dir)
    for bucket in args.bucket:
        files.create_bucket(bucket)
    app = make_app(files, read_credentials(args.credentials))
    web.run_app(app, host=args.host, port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
