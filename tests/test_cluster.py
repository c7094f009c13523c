"""Ray clusters the job did not start: a `ray start` head joined by host:port, ray:// and RAY_ADDRESS; a two-node
cluster (ray.cluster_utils) with input, output and checkpoint on S3; no address with a stale
`ray_current_cluster` left behind; and addresses where no cluster answers.

Each cluster lives in its own process session and its own RAY_TMPDIR (so nothing it writes, such as
ray_current_cluster, touches the machine's /tmp/ray), and is stopped by killing exactly the processes of that
session, by pid, whatever the test's outcome. Runs go through the CLI in a subprocess, away from the session's Ray.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq
from clover_batch.connectors.fs import Location
from clover_batch.connectors.sink import read_output
from conftest import SESSION_CPUS, _free_port, assert_clean_ray_output, requires_engine, write_job

pytestmark = requires_engine

REPO = Path(__file__).resolve().parents[1]
EXAMPLE_JOB = REPO / "jobs" / "examples" / "summarize-local.yaml"


def _session_pids(leader: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                if os.getsid(int(entry)) == leader:
                    pids.append(int(entry))
    return pids


def _stop_session(proc: subprocess.Popen) -> None:
    """SIGKILL every process of the session `proc` leads (Ray's daemons, its workers), by pid."""
    for _ in range(3):  # workers may still be forking while the first ones die
        pids = _session_pids(proc.pid)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if not pids:
            break
        time.sleep(0.5)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


@contextlib.contextmanager
def _private_tmp():
    # Short: Ray puts unix sockets under it (108-byte limit).
    path = tempfile.mkdtemp(prefix="cb-", dir="/tmp")
    try:
        yield path
    finally:
        if not os.environ.get("CB_KEEP"):
            shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def ray_head(tmp: str):
    """`ray start --head --node-ip-address 127.0.0.1` on free ports, of the machine's CPUs (at most 2, as the session's
    Ray); yields (GCS port, Ray Client port)."""
    gcs, client = _free_port(), _free_port()
    # A Ray Client session starts its own server process on the head, given 30 s by default to come up: short
    # on a loaded 2-core CI runner.
    env = {**os.environ, "RAY_TMPDIR": tmp, "RAY_AUTH_MODE": "disabled",
           "RAY_CLIENT_SERVER_CHECK_CHANNEL_TIMEOUT_S": "60"}
    env.pop("RAY_ADDRESS", None)
    cmd = [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block", "--node-ip-address",
           "127.0.0.1", "--port", str(gcs), "--ray-client-server-port", str(client), "--num-cpus", str(SESSION_CPUS),
           "--include-dashboard=false", "--disable-usage-stats"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while not os.path.exists(os.path.join(tmp, "ray", "ray_current_cluster")):
            assert proc.poll() is None, "ray start exited"
            assert time.monotonic() < deadline, "ray start did not come up in 90 s"
            time.sleep(0.2)
        yield gcs, client
    finally:
        _stop_session(proc)


def _cli(*args, env_extra=None, timeout=300):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "clover_batch.jobs.cli", "run", *args], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


def _report(out: Path, stdout: str) -> dict:
    run_id = stdout.split("run ", 1)[1].split(":", 1)[0]
    return json.loads((out / "_reports" / f"{run_id}.json").read_text())


def test_example_job_on_a_ray_start_cluster_by_gcs_address_ray_client_and_ray_address(tmp_path):
    docs = tmp_path / "docs"
    shutil.copytree(REPO / "jobs" / "examples" / "docs", docs)
    out = tmp_path / "out"
    sets = ["--set", f"input.uri={docs}", "--set", f"output.uri={out}", "--set", "decode.max_new_tokens=4"]
    with _private_tmp() as tmp, ray_head(tmp) as (gcs, client):
        first = _cli(str(EXAMPLE_JOB), *sets, "--address", f"127.0.0.1:{gcs}")
        assert first.returncode == 0, first.stdout + first.stderr
        assert_clean_ray_output(first.stderr)
        assert "5 processed, 0 already done" in first.stdout
        assert _report(out, first.stdout)["ray_address"] == f"127.0.0.1:{gcs}"

        (docs / "new-memo.txt").write_text("A new memo: the audit starts Monday.")
        second = _cli(str(EXAMPLE_JOB), *sets, "--address", f"ray://127.0.0.1:{client}")
        assert second.returncode == 0, second.stdout + second.stderr
        assert_clean_ray_output(second.stderr)
        assert "1 processed, 5 already done" in second.stdout
        # the run executed on the cluster (Ray Data cannot run from a Ray Client): it reports the cluster's GCS
        assert _report(out, second.stdout)["ray_address"].endswith(f":{gcs}")

        (docs / "newer-memo.txt").write_text("Another memo: the audit moved to Tuesday.")
        third = _cli(str(EXAMPLE_JOB), *sets, env_extra={"RAY_ADDRESS": f"127.0.0.1:{gcs}"})
        assert third.returncode == 0, third.stdout + third.stderr
        assert "1 processed, 6 already done" in third.stdout
        assert _report(out, third.stdout)["ray_address"] == f"127.0.0.1:{gcs}"
    table = read_output(Location(str(out)))
    assert table.num_rows == 7 and len(set(table.column("doc_id").to_pylist())) == 7
    assert set(table.column("status").to_pylist()) == {"ok"}


def test_no_address_starts_a_local_ray_whatever_a_stale_cluster_file_says(tmp_path):
    """A `ray start` cluster killed without `ray stop` leaves ray_current_cluster behind; plain ray.init() would
    wait minutes on its dead GCS. The run starts its own Ray instead."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "memo.txt").write_text("Memo: the meeting moved.")
    out = tmp_path / "out"
    with _private_tmp() as tmp:
        os.makedirs(os.path.join(tmp, "ray"))
        dead = _free_port()  # nothing listens there
        with open(os.path.join(tmp, "ray", "ray_current_cluster"), "w") as f:
            f.write(f"127.0.0.1:{dead}")
        probe = subprocess.run(
            [sys.executable, "-c", "from ray._private.services import canonicalize_bootstrap_address as c; "
             "print(c(None))"], env={**os.environ, "RAY_TMPDIR": tmp}, capture_output=True, text=True)
        assert probe.stdout.strip().endswith(f":{dead}"), probe  # the dead cluster plain ray.init() would join
        start = time.monotonic()
        result = _cli(str(EXAMPLE_JOB), "--set", f"input.uri={docs}", "--set", f"output.uri={out}",
                      "--set", "decode.max_new_tokens=4", env_extra={"RAY_TMPDIR": tmp}, timeout=180)
        assert result.returncode == 0, result.stdout + result.stderr
        assert time.monotonic() - start < 120
        # the demo job on a Ray of its own: no deprecation warning, no error-level Ray log (lost constructor args)
        assert_clean_ray_output(result.stderr)
        assert _report(out, result.stdout)["ray_address"] == "local"
    assert pq.read_table(str(out)).num_rows == 1


def test_unreachable_address_fails_fast_with_one_line_naming_it(tmp_path):
    import socket

    job = write_job(tmp_path / "job.yaml", {"name": "j", "input": {"uri": str(tmp_path / "in")},
                                            "output": {"uri": str(tmp_path / "out")},
                                            "task": {"kind": "summarize"}})
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.txt").write_text("hello")
    closed = _free_port()
    with socket.socket() as silent:  # accepts connections, never speaks Ray's protocol
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        port = silent.getsockname()[1]
        cases = [(f"127.0.0.1:{closed}", "Connection refused"), (f"ray://127.0.0.1:{closed}", "Connection refused"),
                 (f"127.0.0.1:{port}", "did not answer Ray's protocol")]
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        start = time.monotonic()
        procs = [subprocess.Popen([sys.executable, "-m", "clover_batch.jobs.cli", "run", str(job), "--address", a,
                                   "--set", f"output.uri={tmp_path / f'out{i}'}"],
                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for i, (a, _) in enumerate(cases)]  # side by side: each must fail on its own within 30 s
        for (address, why), proc in zip(cases, procs, strict=True):
            _, stderr = proc.communicate(timeout=60)
            took = time.monotonic() - start
            assert proc.returncode == 1, stderr
            lines = [ln for ln in stderr.splitlines() if ln.startswith("run failed")]
            assert len(lines) == 1 and f"cannot reach the Ray cluster at {address}: " in lines[0], stderr
            assert why in lines[0] and "Traceback" not in stderr
            assert took < 30, (address, took)
    assert not any((tmp_path / f"out{i}").exists() for i in range(3))  # refused before touching the output


class CountingS3:
    """A moto S3 server on 127.0.0.1 that records each request's method and path."""

    def __init__(self):
        from moto.moto_server import threaded_moto_server as tms

        requests = self.requests = []

        class Server(tms.ThreadedMotoServer):
            def _server_entry(self) -> None:
                app = tms.DomainDispatcherApplication(tms.create_backend_app)

                def counting(environ, start_response):
                    requests.append((environ["REQUEST_METHOD"], environ.get("PATH_INFO", "")))
                    return app(environ, start_response)

                self._server = tms.make_server(self._ip_address, self._port, counting, True,
                                               request_handler=tms.MotoRequestHandler)
                self._server_ready_event.set()
                self._server.serve_forever()

        self.port = _free_port()
        self.server = Server(ip_address="127.0.0.1", port=self.port, verbose=False)
        self.options = {"endpoint_url": f"http://127.0.0.1:{self.port}", "key": "testing", "secret": "testing",
                        "region_name": "us-east-1"}


TWO_NODE_SCRIPT = """
import json, os, sys
import ray
from ray.cluster_utils import Cluster
from clover_batch.jobs.runner import run
from clover_batch.jobs.spec import parse_job

args = json.loads(sys.argv[1])
# 6 logical CPUs on this 2-core machine, on purpose: two nodes of 3 CPUs, so that each node holds one replica of 2
# CPUs beside a prep task; what is tested is placement and a checkpoint copy per node, not the machine's capacity
cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 3, "resources": {"node_a": 1},
                                                       "env_vars": {"HOME": args["homes"][0]}})
cluster.add_node(num_cpus=3, resources={"node_b": 1}, env_vars={"HOME": args["homes"][1]})
cluster.wait_for_nodes()
report = run(parse_job(args["job"]), address=cluster.address).report
ray.init(address=cluster.address)
actors = ray._private.state.actors().values()
infer_nodes = {a["Address"]["NodeID"] for a in actors if "InferStage" in a["ActorClassName"]}
print("RESULT " + json.dumps({"report": report.to_json(), "infer_nodes": sorted(infer_nodes),
                              "nodes": sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])}))
ray.shutdown()
cluster.shutdown()
"""


def test_two_node_cluster_with_input_output_and_checkpoint_on_s3(tmp_path):
    import boto3

    s3 = CountingS3()
    s3.server.start()
    try:
        client = boto3.client("s3", endpoint_url=s3.options["endpoint_url"], aws_access_key_id="testing",
                              aws_secret_access_key="testing", region_name="us-east-1")
        client.create_bucket(Bucket="two-nodes")
        ckpt = tmp_path / "ckpt"
        made = subprocess.run([sys.executable, "-m", "clover_batch.jobs.cli", "model", "init", "--preset", "tiny",
                               "--out", str(ckpt)], capture_output=True, text=True)
        assert made.returncode == 0, made.stderr
        for f in ckpt.rglob("*"):
            if f.is_file():
                client.upload_file(str(f), "two-nodes", f"ckpt/{f.relative_to(ckpt)}")
        names = [f"memo-{i}.txt" for i in range(6)]
        for i, name in enumerate(names):
            client.put_object(Bucket="two-nodes", Key=f"in/{name}", Body=f"Memo {i}: room {i} is booked.".encode())
        job = {
            "name": "two-nodes",
            "input": {"uri": "s3://two-nodes/in/", "storage_options": s3.options},
            "output": {"uri": "s3://two-nodes/out/", "storage_options": s3.options, "rows_per_file": 1},
            "model": {"source": "s3://two-nodes/ckpt/", "storage_options": s3.options},
            "task": {"kind": "summarize", "instruction": "Summarize."},
            "decode": {"max_new_tokens": 4},
            # 2 CPUs per replica and 3 per node: the two replicas cannot share a node
            "resources": {"replicas": 2, "cpus_per_replica": 2, "batch_size": 1},
        }
        homes = [str(tmp_path / "home-a"), str(tmp_path / "home-b")]
        s3.requests.clear()
        with _private_tmp() as tmp:
            env = {**os.environ, "RAY_TMPDIR": tmp, "RAY_AUTH_MODE": "disabled"}
            env.pop("RAY_ADDRESS", None)
            proc = subprocess.Popen([sys.executable, "-c", TWO_NODE_SCRIPT, json.dumps({"job": job, "homes": homes})],
                                    env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    start_new_session=True)
            try:
                stdout, stderr = proc.communicate(timeout=300)
            finally:
                _stop_session(proc)
        assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]
        result = json.loads(stdout.split("RESULT ", 1)[1])
        assert result["report"]["processed"] == 6 and result["report"]["by_status"] == {"ok": 6}
        assert len(result["nodes"]) == 2 and result["infer_nodes"] == result["nodes"]  # a replica on each node

        # the checkpoint was copied once per node: one download of its weights per node, one copy in each cache
        weights = [p for m, p in s3.requests if m == "GET" and p.startswith("/two-nodes/ckpt/")
                   and p.endswith(".safetensors")]
        assert len(weights) == 2, weights
        for home in homes:
            cache = Path(home) / ".cache" / "clover-batch" / "checkpoints"
            assert len([p for p in cache.iterdir() if p.is_dir()]) == 1, list(cache.iterdir())

        rows = read_output(Location("s3://two-nodes/out/", s3.options)).to_pylist()
        assert sorted(r["source_uri"].rsplit("/", 1)[-1] for r in rows) == names
        assert {r["status"] for r in rows} == {"ok"}
    finally:
        s3.server.stop()
