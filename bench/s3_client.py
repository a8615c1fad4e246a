"""Client CPU of a whole object's GET and a create-only PUT, ours against botocore's client and
against `s3_direct` as it was at `--previous` (a git revision), in one run on one S3 server.

  get_us.<row>      CPU microseconds of this process a GET of a --size object (process time)
  put_new_us.<row>  the same for a create-only PUT (If-None-Match: *) of a new key
  ours_over_previous, ours_over_botocore, obstore_over_previous, awscrt_over_previous
                    the ratios, GET and PUT
Rows: `ours` is the store's own (`S3Store.get`, `S3Store.put_new`: obstore, pipeline/record/s3.py,
its CRC32 in the object's metadata), `botocore` the boto3 client's get_object and
put_object(IfNoneMatch="*"), `previous` s3_direct.py (and the http1.py it used, if it did) read
from git at `--previous`: issue 73's baseline is the hand-written HTTP/1.1 client of 2565356;
`obstore` (bare, as the store calls it) and `awscrt` clients that sign and frame in native code
(bench/s3_native.py), each where it is installed. The requests go --threads at a time, as
`close` and `verify` keep theirs in flight, to a versitygw on loopback that keeps connections as
S3 does. The rows take turns --chunk requests at a time, so each meets the same drift of this VM's speed;
versitygw's own CPU is in its own process, not counted.

    python bench/s3_client.py [--requests 3000] [--size 2048] [--threads 16] [--runs 3]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import types
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

os.environ.setdefault("BOTO_DISABLE_CRT", "true")  # awscrt's row installed: botocore's rows keep botocore's signer

from bench import measured, s3_native  # noqa: E402
from pipeline.record.storage import IN_FLIGHT, open_store  # noqa: E402
from tests.servers import S3_ACCESS_KEY, S3_SECRET_KEY, start_versitygw  # noqa: E402

PREVIOUS = "2565356"  # main before issue 73's S3 client: s3_direct on record/http1.py


def previous_module(rev: str) -> types.ModuleType | None:
    """s3_direct.py as it was at `rev`, with the http1.py it imported then (gone since): None when
    this clone does not hold `rev`."""
    def source(name: str) -> str | None:
        shown = subprocess.run(["git", "show", f"{rev}:pipeline/record/{name}.py"], cwd=ROOT,
                               capture_output=True, text=True)
        return shown.stdout if shown.returncode == 0 else None

    code = source("s3_direct")
    if code is None:
        return None
    module = types.ModuleType(f"previous_s3_direct_{rev}")
    if "from pipeline.record import http1\n" in code:
        http1 = types.ModuleType(f"previous_http1_{rev}")
        sys.modules[http1.__name__] = http1
        exec(compile(source("http1"), f"{rev}:pipeline/record/http1.py", "exec"), http1.__dict__)
        code, module.http1 = code.replace("from pipeline.record import http1\n", ""), http1
    sys.modules[module.__name__] = module
    exec(compile(code, f"{rev}:pipeline/record/s3_direct.py", "exec"), module.__dict__)
    return module


def rows(store, client, previous: types.ModuleType | None) -> dict[str, tuple]:
    """Each row's (get(key), put_new(key, data)) on the store's bucket; `client` boto3's, as the
    store made it before issue 73."""
    bucket = store.bucket

    def boto_get(key):
        return client.get_object(Bucket=bucket, Key=key)["Body"].read()

    def boto_put(key, data):
        client.put_object(Bucket=bucket, Key=key, Body=data, IfNoneMatch="*")

    made = {"ours": (store.get, store.put_new), "botocore": (boto_get, boto_put)}
    if previous is not None:
        import botocore.session

        send = previous.sender(client, botocore.session.get_session(), IN_FLIGHT)
        made["previous"] = (lambda key: previous.get(send, bucket, key),
                            lambda key, data: previous.put_new(send, bucket, key, data))
    return made | s3_native.rows(client.meta.endpoint_url, client.meta.region_name, bucket, S3_ACCESS_KEY, S3_SECRET_KEY)


def boto_client():
    """boto3's S3 client as the store configured it before issue 73."""
    import boto3
    from botocore.config import Config

    config = Config(retries={"mode": "adaptive", "max_attempts": 10}, max_pool_connections=IN_FLIGHT,
                    s3={"addressing_style": "path"})
    return boto3.client("s3", config=config)


def timed(threads: ThreadPoolExecutor, fn, jobs: list[tuple]) -> float:
    """CPU seconds of this process for fn(*job) over the jobs, `threads` at a time."""
    started = time.process_time()
    for _ in threads.map(lambda job: fn(*job), jobs):
        pass
    return time.process_time() - started


def once(args) -> dict:
    with tempfile.TemporaryDirectory(prefix="cn-bench-s3-", ignore_cleanup_errors=True) as scratch:
        work = Path(scratch)
        s3 = start_versitygw(work / "s3", keep_alive=True)
        try:
            os.environ.update({"AWS_ENDPOINT_URL": s3.url, "AWS_ACCESS_KEY_ID": S3_ACCESS_KEY,
                               "AWS_SECRET_ACCESS_KEY": S3_SECRET_KEY, "AWS_DEFAULT_REGION": "us-east-1"})
            store, client = open_store("s3://bench-s3-client"), boto_client()
            client.create_bucket(Bucket=store.bucket)
            made = rows(store, client, previous_module(args.previous))
            data = os.urandom(args.size)
            objects = [f"{n % 10}/get/{n:06d}" for n in range(args.requests)]
            with ThreadPoolExecutor(args.threads) as threads:
                list(threads.map(lambda key: store.put(key, data), objects))
                for get, put in made.values():  # connections opened, modules warm
                    assert get(objects[0]) == data
                    put(f"warm/{uuid.uuid4().hex}", data)
                spent = {name: [0.0, 0.0] for name in made}
                for k in range(0, args.requests, args.chunk):
                    part = objects[k:k + args.chunk]
                    for name, (get, put) in made.items():
                        spent[name][0] += timed(threads, get, [(key,) for key in part])
                        spent[name][1] += timed(threads, put, [(f"{name}/{key}", data) for key in part])
            us = {name: [round(s * 1e6 / args.requests, 1) for s in pair] for name, pair in spent.items()}
            result = {"requests": args.requests, "size": args.size, "threads": args.threads,
                      "get_us": {name: pair[0] for name, pair in us.items()},
                      "put_new_us": {name: pair[1] for name, pair in us.items()}}
            for base in ("previous", "botocore"):
                if base in us:
                    result[f"ours_over_{base}"] = {"get": round(us["ours"][0] / us[base][0], 3),
                                                  "put_new": round(us["ours"][1] / us[base][1], 3)}
            for name in s3_native.missing():
                result[name] = "not installed"
            for native in ("obstore", "awscrt"):
                if native in us and "previous" in us:
                    result[f"{native}_over_previous"] = {"get": round(us[native][0] / us["previous"][0], 3),
                                                         "put_new": round(us[native][1] / us["previous"][1], 3)}
            return result | ({} if "previous" in us else {"previous": f"{args.previous} is not in this clone"})
        finally:
            s3.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=3000, help="GETs and as many PUTs a row")
    parser.add_argument("--size", type=int, default=2048, help="bytes an object")
    parser.add_argument("--threads", type=int, default=16, help="requests in flight")
    parser.add_argument("--chunk", type=int, default=200, help="requests a row takes in turn")
    parser.add_argument("--previous", default=PREVIOUS, help="the git revision whose s3_direct is the baseline")
    parser.add_argument("--runs", type=int, default=1, help="run it this many times; each prints its JSON line")
    args = measured.with_smoke(parser, {"requests": 40, "chunk": 20, "threads": 4})
    results = []
    for _ in range(args.runs):
        results.append(once(args))
        print(json.dumps(results[-1]), flush=True)
    if len(results) > 1:
        middle, spread = measured.median(results)
        print(json.dumps({"median": middle, "spread": spread}), flush=True)


if __name__ == "__main__":
    main()
