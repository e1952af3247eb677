"""Files named by records: a `file://` URI on a topic is used only when it lies inside the
node's stores under the record's own org and job (`<store>/<org>/<job>/`): a record may not
point a service at another org's checkpoint, at /etc/passwd, or anywhere else."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from urllib.parse import unquote, urlparse


def job_dir(store: Path, org_id: str, job_id: str) -> Path:
    return store / org_id / job_id


def path_in_job_store(uri: str, stores: Iterable[Path], org_id: str, job_id: str) -> Path | None:
    """The file a `file://` URI names, symlinks resolved, if it lies inside one of `stores`
    under `<org_id>/<job_id>/`; else None."""
    parsed = urlparse(uri)
    if parsed.scheme != "file" or parsed.netloc not in ("", "localhost"):
        return None
    path = Path(unquote(parsed.path)).resolve()
    for store in stores:
        if path.is_relative_to(job_dir(store.resolve(), org_id, job_id)):
            return path
    return None
