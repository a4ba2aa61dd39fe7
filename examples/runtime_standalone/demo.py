"""The sandbox runtime server standalone, and a short scripted agent session against it.

    python examples/runtime_standalone/demo.py [--url http://127.0.0.1:8765] [--backend bwrap]

Without --url it starts `prorl-sandbox serve` itself (embedded defaults: bubblewrap, loopback, a temporary
state dir) and stops it at the end. Each step prints what an agent's tool call would get back.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import os
import socket
import subprocess
import sys
import tarfile
import tempfile
import time

import httpx

from sandbox_runtime.client import SandboxClient


@contextlib.contextmanager
def local_server(backend: str | None):
    """Start the server as a separate process, as a platform team would run it, and wait for /healthz. Its
    socket is bound here and handed to it (--listen-fd): the port is known before the server starts, and no
    other process can take it meanwhile."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="prorl-demo-") as state:
        argv = [sys.executable, "-m", "sandbox_runtime", "serve", "--listen-fd", str(listener.fileno())]
        argv += ["--state-dir", state] + (["--backend", backend] if backend else [])
        with listener:  # the server holds its own copy once started
            server = subprocess.Popen(argv, pass_fds=(listener.fileno(),))
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 30
            while True:
                if server.poll() is not None:
                    raise SystemExit(f"the server exited with status {server.returncode}")
                with contextlib.suppress(httpx.TransportError):
                    if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                        break
                if time.monotonic() > deadline:
                    raise SystemExit("the server did not answer /healthz within 30 s")
                time.sleep(0.05)
            yield url
        finally:
            server.terminate()
            server.wait(timeout=30)


def show(step: str, result) -> None:
    output = result.output if len(result.output) < 400 else result.output[:200] + " ... " + result.output[-150:]
    print(f"\n$ {step}")
    print(
        f"  status={result.status} exit_code={result.exit_code} cwd={result.cwd} "
        f"duration={result.duration_s * 1000:.1f} ms truncated={result.truncated}"
    )
    for line in output.rstrip("\n").splitlines()[:12]:
        print(f"  | {line}")


async def session(url: str, token: str | None) -> None:
    async with SandboxClient(url, token=token) as client:
        info = await client.info()
        backends = ", ".join(f"{b.name}{'' if b.available else ' (absent)'}" for b in info.backends)
        print(f"prorl-sandbox {info.version} at {url}; default backend {info.default_backend}; known: {backends}")
        started = time.perf_counter()
        box = await client.create_sandbox(limits={"memory_mb": 1024, "pids": 128}, labels={"demo": "1"})
        print(
            f"sandbox {box.id} ({box.backend}, network {box.network}) ready in "
            f"{(time.perf_counter() - started) * 1000:.1f} ms, workdir {box.workdir}"
        )
        try:
            await client.write_file(box.id, "app/calc.py", "import sys\nprint(sum(map(int, sys.argv[1:])))\n")
            show("python3 app/calc.py 20 22", await client.exec(box.id, "python3 app/calc.py 20 22"))
            show(
                "cd app && export MODE=test (state persists)",
                await client.exec(box.id, "cd app && export MODE=test"),
            )
            show("echo $MODE; pwd", await client.exec(box.id, "echo $MODE; pwd"))
            show("sleep 30 with a 0.5 s timeout", await client.exec(box.id, "sleep 30", timeout=0.5))
            show(
                "curl-free network probe",
                await client.exec(
                    box.id,
                    "python3 -c 'import socket; socket.create_connection((\"1.1.1.1\", 53), 2)' 2>&1 | tail -1",
                ),
            )
            kept = await client.exec(box.id, "read -p 'name? ' who; echo hello $who", timeout=0.3, on_timeout="keep")
            show("read a name (on_timeout=keep)", kept)
            show("input: 'agent\\n'", await client.send_input(box.id, "default", text="agent\n", timeout=5))
            show("50 MB of output", await client.exec(box.id, "head -c 50000000 /dev/zero | tr '\\0' x; echo"))
            archive = await client.download_archive(box.id, "app")
            with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
                print(f"\narchive of app/: {tar.getnames()}")
        finally:
            await client.delete_sandbox(box.id)
            print(f"\nsandbox {box.id} deleted: every process gone, workspace removed")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="an already running server; default: start one")
    parser.add_argument("--backend", default=None, help="backend of the server this demo starts")
    args = parser.parse_args()
    token = os.environ.get("PRORL_SANDBOX_TOKEN")
    if args.url:
        asyncio.run(session(args.url, token))
    else:
        with local_server(args.backend) as url:
            asyncio.run(session(url, token))


if __name__ == "__main__":
    main()
