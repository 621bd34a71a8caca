"""How long does a training state take to save and to resume on an S3 endpoint, next to the local disk?

    python benchmarks/object_storage_speed.py [--width 2048] [--layers 3] [--repeats 5] [--endpoint URL]

Without ``--endpoint`` it starts moto's S3 server on localhost (``pip install 'moto[s3]' flask flask-cors s3fs``),
so the figures measure the upload protocol (mirror, one object per file, manifest last) and the local network stack,
not a real store's bandwidth. Saves are ``save_training_state``; a resume is ``load_training_state`` of the newest
state (for S3: listing, downloading each file once, verifying). Prints a markdown table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path

from training_state_speed import _trainer


def _start_moto() -> tuple:
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # the server would print every request

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    return server, f"http://127.0.0.1:{port}"


def measure(width: int, layers: int, repeats: int, endpoint: str, root: Path) -> dict:
    import fsspec

    fsspec.config.conf["s3"] = {"endpoint_url": endpoint}
    store = fsspec.filesystem("s3", skip_instance_cache=True)
    store.mkdir("bench-bucket")
    trainer = _trainer(width, layers)
    times: dict = {"disk_save": [], "disk_resume": [], "s3_save": [], "s3_resume": []}
    for repeat in range(repeats):
        for place, location in (("disk", root / f"states-{repeat}"), ("s3", f"s3://bench-bucket/states-{repeat}")):
            start = time.perf_counter()
            trainer.save_training_state(location)
            times[f"{place}_save"].append(time.perf_counter() - start)
            start = time.perf_counter()
            trainer.load_training_state(location)
            times[f"{place}_resume"].append(time.perf_counter() - start)
    files = store.find("bench-bucket/states-0")
    state_mib = sum(store.size(path) for path in files) / 2**20
    return {
        "width": width,
        "layers": layers,
        "repeats": repeats,
        "state_mib": state_mib,
        "median_s": {name: statistics.median(values) for name, values in times.items()},
        "raw_s": times,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--endpoint", default=None, help="an S3 endpoint URL (default: moto's server on localhost)")
    arguments = parser.parse_args()
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    server, endpoint = (None, arguments.endpoint) if arguments.endpoint else _start_moto()
    try:
        with tempfile.TemporaryDirectory() as folder:
            result = measure(arguments.width, arguments.layers, arguments.repeats, endpoint, Path(folder))
    finally:
        if server is not None:
            server.stop()
    medians = result["median_s"]
    print(f"| training state ({result['state_mib']:.0f} MiB) | local disk | S3 ({endpoint}) |")
    print("|---|---|---|")
    print(f"| save (median of {result['repeats']}) | {medians['disk_save']:.2f} s | {medians['s3_save']:.2f} s |")
    print(f"| resume (median of {result['repeats']}) | {medians['disk_resume']:.2f} s | {medians['s3_resume']:.2f} s |")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
